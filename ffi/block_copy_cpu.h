// The CPU block-copy engine: executes a BlockCopyRequest with memcpy runs.
#ifndef JAXKV_FFI_BLOCK_COPY_CPU_H_
#define JAXKV_FFI_BLOCK_COPY_CPU_H_

#include "block_index.h"

namespace jaxkv {

// Copies every valid pair of `request` synchronously. Ids must already be validated by the
// caller; ids out of range are skipped here regardless, so memory outside the buffers is
// never touched.
void CopyBlocksCpu(const BlockCopyRequest& request);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_COPY_CPU_H_
