#include "block_file_io.h"

#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <thread>
#include <vector>

namespace jaxkv {
namespace {

constexpr int kStripes = 4;
constexpr uint32_t kCastagnoli = 0x82F63B78u;  // Reflected CRC-32C polynomial.

// Slicing-by-8 tables: table[0] is the classic byte table, table[k] advances a byte k more.
struct Crc32cTables {
  uint32_t table[8][256];
  Crc32cTables() {
    for (uint32_t byte = 0; byte < 256; ++byte) {
      uint32_t crc = byte;
      for (int bit = 0; bit < 8; ++bit) crc = (crc >> 1) ^ (kCastagnoli & (0u - (crc & 1u)));
      table[0][byte] = crc;
    }
    for (int k = 1; k < 8; ++k) {
      for (int byte = 0; byte < 256; ++byte) {
        const uint32_t previous = table[k - 1][byte];
        table[k][byte] = (previous >> 8) ^ table[0][previous & 0xFF];
      }
    }
  }
};

const Crc32cTables& Tables() {
  static const Crc32cTables tables;
  return tables;
}

// CRC state update (no initial value or final xor) over `bytes` bytes, in software.
uint32_t Crc32cSoftware(uint32_t state, const unsigned char* data, int64_t bytes) {
  const auto& t = Tables().table;
  while (bytes >= 8) {
    uint64_t word;
    std::memcpy(&word, data, 8);
    const uint64_t x = word ^ state;  // Little-endian: the state mixes into the first 4 bytes.
    state = t[7][x & 0xFF] ^ t[6][(x >> 8) & 0xFF] ^ t[5][(x >> 16) & 0xFF] ^
            t[4][(x >> 24) & 0xFF] ^ t[3][(x >> 32) & 0xFF] ^ t[2][(x >> 40) & 0xFF] ^
            t[1][(x >> 48) & 0xFF] ^ t[0][x >> 56];
    data += 8;
    bytes -= 8;
  }
  while (bytes-- > 0) state = (state >> 8) ^ t[0][(state ^ *data++) & 0xFF];
  return state;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t Crc32cHardware(uint32_t state,
                                                          const unsigned char* data,
                                                          int64_t bytes) {
  uint64_t wide = state;
  while (bytes >= 8) {
    uint64_t word;
    std::memcpy(&word, data, 8);
    wide = _mm_crc32_u64(wide, word);
    data += 8;
    bytes -= 8;
  }
  state = static_cast<uint32_t>(wide);
  while (bytes-- > 0) state = _mm_crc32_u8(state, *data++);
  return state;
}

// Four chains at once over `bytes` (a multiple of 8) of each lane: the CRC instruction has a
// latency of about three cycles and a throughput of one per cycle.
__attribute__((target("sse4.2"))) void Crc32cHardware4(uint32_t state[kStripes],
                                                       const unsigned char* data[kStripes],
                                                       int64_t bytes) {
  uint64_t s0 = state[0], s1 = state[1], s2 = state[2], s3 = state[3];
  const unsigned char *p0 = data[0], *p1 = data[1], *p2 = data[2], *p3 = data[3];
  for (int64_t i = 0; i < bytes; i += 8) {
    uint64_t w0, w1, w2, w3;
    std::memcpy(&w0, p0 + i, 8);
    std::memcpy(&w1, p1 + i, 8);
    std::memcpy(&w2, p2 + i, 8);
    std::memcpy(&w3, p3 + i, 8);
    s0 = _mm_crc32_u64(s0, w0);
    s1 = _mm_crc32_u64(s1, w1);
    s2 = _mm_crc32_u64(s2, w2);
    s3 = _mm_crc32_u64(s3, w3);
  }
  state[0] = static_cast<uint32_t>(s0);
  state[1] = static_cast<uint32_t>(s1);
  state[2] = static_cast<uint32_t>(s2);
  state[3] = static_cast<uint32_t>(s3);
}
#endif

bool DetectHardwareCrc32c() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("sse4.2");
#else
  return false;
#endif
}

const bool kHardware = DetectHardwareCrc32c();

uint32_t Crc32cUpdate(uint32_t state, const unsigned char* data, int64_t bytes, bool hardware) {
#if defined(__x86_64__)
  if (hardware) return Crc32cHardware(state, data, bytes);
#endif
  (void)hardware;
  return Crc32cSoftware(state, data, bytes);
}

// A position in a payload made of regions, with the bytes left in its stripe.
struct Cursor {
  const MemoryRegion* region;
  const MemoryRegion* end;
  int64_t offset;  // Within *region.
  int64_t left;    // Bytes of the stripe still to checksum.

  // Skips exhausted (and empty) regions; `left` bytes must remain in the payload.
  void Settle() {
    while (left > 0 && region != end && offset >= region->bytes) {
      ++region;
      offset = 0;
    }
  }
  int64_t Run() const { return std::min(left, region->bytes - offset); }
  const unsigned char* Data() const {
    return reinterpret_cast<const unsigned char*>(region->data) + offset;
  }
  void Advance(int64_t bytes) {
    offset += bytes;
    left -= bytes;
    Settle();
  }
};

}  // namespace

int64_t StripeBytes(int64_t total) {
  const int64_t quarter = (total + kStripes - 1) / kStripes;
  return (quarter + 63) / 64 * 64;
}

bool HardwareCrc32c() { return kHardware; }

void StripedCrc32c(const MemoryRegion* regions, int64_t count, uint32_t out[4], bool software) {
  const bool hardware = kHardware && !software;
  int64_t total = 0;
  for (int64_t i = 0; i < count; ++i) total += std::max<int64_t>(0, regions[i].bytes);
  const int64_t stripe = StripeBytes(total);
  std::array<Cursor, kStripes> lanes;
  std::array<uint32_t, kStripes> state;
  // Seek each lane to its stripe's first byte.
  const MemoryRegion* region = regions;
  const MemoryRegion* const end = regions + count;
  int64_t region_start = 0;
  for (int k = 0; k < kStripes; ++k) {
    const int64_t begin = std::min(total, k * stripe);
    while (region != end && region_start + std::max<int64_t>(0, region->bytes) <= begin &&
           begin < total) {
      region_start += std::max<int64_t>(0, region->bytes);
      ++region;
    }
    lanes[k] = Cursor{region, end, begin - region_start, std::min(total, begin + stripe) - begin};
    lanes[k].Settle();
    state[k] = 0xFFFFFFFFu;
  }
  while (true) {
    bool all = true, any = false;
    int64_t common = INT64_MAX;
    for (const Cursor& lane : lanes) {
      if (lane.left > 0) {
        any = true;
        common = std::min(common, lane.Run());
      } else {
        all = false;
      }
    }
    if (!any) break;
#if defined(__x86_64__)
    if (all && hardware && common >= 64) {
      const int64_t bytes = common & ~int64_t{7};
      const unsigned char* data[kStripes];
      for (int k = 0; k < kStripes; ++k) data[k] = lanes[k].Data();
      Crc32cHardware4(state.data(), data, bytes);
      for (Cursor& lane : lanes) lane.Advance(bytes);
      continue;
    }
#endif
    // Ragged ends (region boundaries, the short last stripe): one lane at a time.
    for (int k = 0; k < kStripes; ++k) {
      Cursor& lane = lanes[k];
      if (lane.left <= 0) continue;
      const int64_t bytes = lane.Run();
      state[k] = Crc32cUpdate(state[k], lane.Data(), bytes, hardware);
      lane.Advance(bytes);
    }
  }
  for (int k = 0; k < kStripes; ++k) out[k] = state[k] ^ 0xFFFFFFFFu;
}

namespace {

// Reads one block file: header and payload in one preadv, continued after short reads.
void ReadBlockFile(BlockFileRead& read) {
  std::vector<iovec> iov;
  iov.reserve(static_cast<size_t>(read.num_regions) + 1);
  int64_t total = 0;
  if (read.header_bytes > 0) {
    iov.push_back(iovec{read.header, static_cast<size_t>(read.header_bytes)});
    total += read.header_bytes;
  }
  for (int64_t i = 0; i < read.num_regions; ++i) {
    if (read.regions[i].bytes <= 0) continue;
    iov.push_back(iovec{read.regions[i].data, static_cast<size_t>(read.regions[i].bytes)});
    total += read.regions[i].bytes;
  }
  size_t first = 0;
  int64_t done = 0;
  while (first < iov.size()) {
    const int n = static_cast<int>(std::min<size_t>(iov.size() - first, IOV_MAX));
    const ssize_t got = preadv(read.fd, &iov[first], n, done);
    if (got < 0) {
      if (errno == EINTR) continue;
      read.error = errno;
      break;
    }
    if (got == 0) break;  // End of file: a truncated block.
    done += got;
    size_t left = static_cast<size_t>(got);
    while (left > 0 && first < iov.size()) {
      if (left >= iov[first].iov_len) {
        left -= iov[first].iov_len;
        ++first;
      } else {
        iov[first].iov_base = static_cast<char*>(iov[first].iov_base) + left;
        iov[first].iov_len -= left;
        left = 0;
      }
    }
  }
  read.bytes_read = done;
  if (read.error == 0 && done == total) {
    StripedCrc32c(read.regions, read.num_regions, read.checksum);
    read.checksummed = true;
  }
}

}  // namespace

void ReadBlockFiles(BlockFileRead* reads, int64_t count, unsigned threads) {
  threads = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  std::atomic<int64_t> next{0};
  auto work = [&] {
    for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) ReadBlockFile(reads[i]);
  };
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  for (unsigned t = 1; t < threads; ++t) workers.emplace_back(work);
  work();
  for (auto& worker : workers) worker.join();
}

}  // namespace jaxkv
