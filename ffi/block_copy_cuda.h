// The CUDA block-copy engine: executes BlockCopyRequests (one kernel launch) and
// BlockRewriteRequests (one launch staging through shared memory, or two launches per chunk
// through the request's staging buffer when a unit does not fit).
#ifndef JAXKV_FFI_BLOCK_COPY_CUDA_H_
#define JAXKV_FFI_BLOCK_COPY_CUDA_H_

#include <cuda_runtime_api.h>

#include "block_index.h"

namespace jaxkv {

// Enqueues the copy of every valid pair of `request` on `stream`. `request.src_side.ids`,
// `request.dst_side.ids` and `request.num_rows` must be device pointers. Ids out of range are
// skipped inside the kernel, so memory outside the buffers is never touched. Returns the
// launch status.
cudaError_t LaunchBlockCopy(const BlockCopyRequest& request, cudaStream_t stream);

// Enqueues the in-place rewrite of every listed block of `request` on `stream` (ids on the
// device, unique). `request.staging` is device memory; it is only used when a unit is larger
// than the shared memory a block of threads may have.
cudaError_t LaunchBlockRewrite(const BlockRewriteRequest& request, cudaStream_t stream);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_COPY_CUDA_H_
