// FFI handler symbols of the jaxkv block operations, for CPU and CUDA. Both platforms
// register the same target names (module.cc lists them); see block_ops_impl.h and
// reshape_ops_impl.h for what each one does.
#ifndef JAXKV_FFI_BLOCK_OPS_H_
#define JAXKV_FFI_BLOCK_OPS_H_

#include "xla/ffi/api/ffi.h"

namespace jaxkv {

XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyBlocksCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherBlocksCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherBlocksIntoCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ScatterBlocksCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RearrangeBlocksCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyBlockPrefixCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyBlockPrefixInPlaceCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SplitBlocksCpu_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConcatBlocksCpu_Handler);

XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyBlocksCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherBlocksCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(GatherBlocksIntoCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ScatterBlocksCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(RearrangeBlocksCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyBlockPrefixCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(CopyBlockPrefixInPlaceCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(SplitBlocksCuda_Handler);
XLA_FFI_DECLARE_HANDLER_SYMBOL(ConcatBlocksCuda_Handler);

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_OPS_H_
