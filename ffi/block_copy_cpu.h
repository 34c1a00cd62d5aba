// The CPU block-copy engine: executes BlockCopyRequests and BlockRewriteRequests with memcpy
// runs.
#ifndef JAXKV_FFI_BLOCK_COPY_CPU_H_
#define JAXKV_FFI_BLOCK_COPY_CPU_H_

#include <cstdint>

#include "block_index.h"

namespace jaxkv {

// Copies every valid pair of `request` synchronously. Ids must already be validated by the
// caller; ids out of range are skipped here regardless, so memory outside the buffers is
// never touched.
void CopyBlocksCpu(const BlockCopyRequest& request);

// Several requests over the same pairs (`num_pairs` equal), run pair-major: pair i of every
// request before pair i + 1, so a source block that several requests read (the buffers of a
// split) or a destination block that several requests write (a concat) moves through memory
// once. The requests must not write bytes that another one reads.
void CopyBlocksCpu(const BlockCopyRequest* requests, int64_t count);

// Rewrites every listed block of `request` in place, one staged unit at a time (each thread
// stages in its own unit-sized slice of `request.staging`). Ids out of range are skipped;
// ids must be unique (checked by the caller), or a block would be rewritten twice.
void RewriteBlocksCpu(const BlockRewriteRequest& request);

// Byte ranges to copy between host buffers: `count` chunks of `length` bytes, read every
// `src_stride` bytes from `src` and written every `dst_stride` bytes from `dst`.
struct ByteRow {
  const char* src;
  char* dst;
  int64_t length;
  int64_t count;
  int64_t src_stride;
  int64_t dst_stride;
};

// Copies every chunk of `rows` in order, on the calling thread, prefetching the chunks ahead
// and, for large copies, with streaming stores. The rows must already be checked against
// their buffers (this function trusts every pointer) and must not overlap each other's
// destinations or read what another row writes.
void CopyByteRowsCpu(const ByteRow* rows, int64_t num_rows);

// Advises the kernel to back a freshly allocated, not yet touched output buffer with huge
// pages, so that writing it takes a few hundred page faults instead of one per 4 KiB (measured
// here: a first-touch 64 MiB copy goes from 3.8 to 14 GB/s). Only the 2 MiB-aligned interior
// of buffers of at least 4 MiB is advised; elsewhere, or where the kernel refuses, nothing
// happens. Never call it on a buffer that other code is using: it only changes page policy,
// but the advice outlives the call.
void AdviseFreshOutput(void* data, int64_t bytes);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_COPY_CPU_H_
