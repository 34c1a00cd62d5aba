// The CUDA block-copy engine: executes a BlockCopyRequest with one kernel launch.
#ifndef JAXKV_FFI_BLOCK_COPY_CUDA_H_
#define JAXKV_FFI_BLOCK_COPY_CUDA_H_

#include <cuda_runtime_api.h>

#include "block_index.h"

namespace jaxkv {

// Enqueues the copy of every valid pair of `request` on `stream`. `request.src_side.ids` and
// `request.dst_side.ids` must be device pointers. Ids out of range are skipped inside the
// kernel, so memory outside the buffers is never touched. Returns the launch status.
cudaError_t LaunchBlockCopy(const BlockCopyRequest& request, cudaStream_t stream);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_COPY_CUDA_H_
