// The file tier's native I/O: the payload checksum and batched block-file reads that verify
// as they go, with no Python (and no GIL) in the loop.
#ifndef JAXKV_FFI_BLOCK_FILE_IO_H_
#define JAXKV_FFI_BLOCK_FILE_IO_H_

#include <cstdint>

namespace jaxkv {

// A span of host memory; a block payload is one or more of them, in order.
struct MemoryRegion {
  char* data;
  int64_t bytes;
};

// The payload checksum: the payload (the concatenation of `regions`) is cut into four stripes
// of `StripeBytes(total)` bytes (the last one shorter, possibly empty) and each stripe gets its
// CRC-32C (Castagnoli, as in iSCSI/ext4: reflected polynomial 0x82F63B78, initial value and
// final xor 0xFFFFFFFF). Four independent CRCs run interleaved, which is what lets the CRC
// instruction reach memory speed (one CRC chain is latency bound at a third of it).
//
// `out[k]` is stripe k's CRC. With `software` the table implementation is used even where the
// CPU has a CRC-32C instruction (for tests; both give the same values).
void StripedCrc32c(const MemoryRegion* regions, int64_t count, uint32_t out[4],
                   bool software = false);

// The stripe length of a payload of `total` bytes: ceil(total / 4) rounded up to 64 bytes.
int64_t StripeBytes(int64_t total);

// Whether StripedCrc32c uses the CPU's CRC-32C instruction (SSE 4.2) on this machine.
bool HardwareCrc32c();

// One block file to read: `header_bytes` at offset 0 go to `header`, the payload that follows
// goes to `regions`. Filled in by ReadBlockFiles: the bytes read (short for a truncated file),
// the errno of a failed read (0 when none), and the payload checksum when the whole file was
// read.
struct BlockFileRead {
  int fd;
  char* header;
  int64_t header_bytes;
  const MemoryRegion* regions;
  int64_t num_regions;
  int64_t bytes_read = 0;
  int error = 0;
  bool checksummed = false;
  uint32_t checksum[4] = {0, 0, 0, 0};
};

// Reads each block (one preadv per block, repeated after a short read until end of file) and
// checksums its payload right after its read, while it is still in cache. Blocks are spread
// over up to `threads` threads (the calling one included); each block is read by one thread.
void ReadBlockFiles(BlockFileRead* reads, int64_t count, unsigned threads);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_FILE_IO_H_
