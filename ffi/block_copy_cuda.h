// The CUDA block-copy engine: executes BlockCopyRequests (one kernel launch) and
// BlockRewriteRequests (one launch staging each unit through shared memory, or two launches per
// chunk through the request's staging buffer when a unit does not fit), and checks id lists on
// the device (validate_ids) without synchronising with the host.
#ifndef JAXKV_FFI_BLOCK_COPY_CUDA_H_
#define JAXKV_FFI_BLOCK_COPY_CUDA_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "block_index.h"

namespace jaxkv {

// The outcome of enqueueing work: on failure, the CUDA runtime call that failed (for the
// message) and its error. A failed call's error has already been consumed from the thread's
// last-error state, so it is never reported again by a later, healthy launch.
struct CudaStatus {
  cudaError_t error = cudaSuccess;
  const char* call = nullptr;
  bool ok() const { return error == cudaSuccess; }
};

// `error` as a CudaStatus naming `call`. A failed call's error is consumed from the thread's
// last-error state (cudaGetLastError), so that the next healthy launch does not report it.
inline CudaStatus Checked(cudaError_t error, const char* call) {
  if (error == cudaSuccess) return {};
  cudaGetLastError();
  return {error, call};
}

// Bits of an id-check verdict (and of the per-device record TakeIdErrors returns).
constexpr uint32_t kIdOutOfRange = 1;  // an id >= the number of blocks of its buffer
constexpr uint32_t kIdRepeated = 2;    // a written block listed twice
constexpr uint32_t kIdShared = 4;      // a block both read and written by an in-place copy

// One id list (or a pair of lists of equal length) to check on the device. `ids` is
// range-checked against `num_blocks` and, with `unique`, checked for repeats; `other_ids`
// (optional) is range-checked against `other_blocks` and, with `disjoint`, must share no
// block with `ids` (both then index one buffer of `num_blocks` blocks). Negative ids are
// padding.
struct IdCheckRequest {
  const int32_t* ids = nullptr;
  int64_t count = 0;
  int64_t num_blocks = 0;
  bool unique = false;
  const int32_t* other_ids = nullptr;
  int64_t other_blocks = 0;
  bool disjoint = false;
};

// Words of device memory LaunchIdCheck needs for `request`: one bit per block of `ids`' buffer
// for the repeat and overlap checks, else none.
inline int64_t IdCheckBitmapWords(const IdCheckRequest& request) {
  return request.unique || request.disjoint ? (request.num_blocks + 31) / 32 : 0;
}

// Enqueues the check of `request` on `stream`: kernels OR the kId* bits of every problem found
// into `*verdict` (device memory the caller zeroed) and into the device's record
// (TakeIdErrors). `bitmap` is device memory of IdCheckBitmapWords words (zeroed here). Nothing
// is read back on the host.
CudaStatus LaunchIdCheck(const IdCheckRequest& request, uint32_t* verdict, uint32_t* bitmap,
                         cudaStream_t stream);

// Reads and clears device `device`'s record of id-check failures since the last call (kId*
// bits, 0 when none). It waits for the whole device (cudaDeviceSynchronize) first: call it
// outside custom calls, where a synchronisation is wanted (tests, a checking step).
CudaStatus TakeIdErrors(int device, uint32_t* errors);

// Enqueues the copy of every valid pair of `request` on `stream`. `request.src_side.ids`,
// `request.dst_side.ids` and `request.num_rows` must be device pointers. Ids out of range are
// skipped inside the kernel, so memory outside the buffers is never touched. With `verdict`
// (device memory, from LaunchIdCheck on the same stream) the kernel writes nothing when the
// verdict is non-zero, except that a zero-filling request (a dense output) is all zeros.
CudaStatus LaunchBlockCopy(const BlockCopyRequest& request, const uint32_t* verdict,
                           cudaStream_t stream);

// The staging bytes LaunchBlockRewrite needs for `request` on the current device: 0 when its
// units are staged in shared memory, else one block (the chunk size of the two-launch path).
CudaStatus RewriteStagingBytes(const BlockRewriteRequest& request, int64_t* bytes);

// Enqueues the in-place rewrite of every listed block of `request` on `stream` (ids on the
// device, unique; out-of-range ids skipped). `request.staging` is device memory of at least
// RewriteStagingBytes; more lets the two-launch path move several blocks per launch. With
// `verdict` as for LaunchBlockCopy.
CudaStatus LaunchBlockRewrite(const BlockRewriteRequest& request, const uint32_t* verdict,
                              cudaStream_t stream);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_COPY_CUDA_H_
