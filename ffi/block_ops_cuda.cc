// CUDA FFI handlers. Ids live in device memory: with `validate_ids` they are copied to the
// host (one small copy and a stream synchronisation) and checked before the launch, so bad ids
// raise an error; without it the kernel still skips ids that are out of range, so memory
// outside the buffers is never touched, but nothing is reported.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "block_copy_cuda.h"
#include "block_ops.h"
#include "block_ops_impl.h"
#include "reshape_ops_impl.h"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {
namespace {

namespace ffi = xla::ffi;

ffi::Error CudaError(cudaError_t status, const char* what) {
  if (status == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxkv CUDA ") + what + " failed: " +
                              cudaGetErrorString(status));
}

struct CudaPlatform {
  cudaStream_t stream;
  bool validate_ids;

  ffi::ErrorOr<const int32_t*> HostIds(const IdBuffer& ids, std::vector<int32_t>* storage) {
    if (!validate_ids) return static_cast<const int32_t*>(nullptr);
    storage->resize(ids.element_count());
    if (storage->empty()) return storage->data();
    ffi::Error error =
        CudaError(cudaMemcpyAsync(storage->data(), ids.typed_data(),
                                  storage->size() * sizeof(int32_t), cudaMemcpyDeviceToHost,
                                  stream),
                  "id copy");
    if (error.failure()) return ffi::Unexpected(error);
    error = CudaError(cudaStreamSynchronize(stream), "stream synchronisation");
    if (error.failure()) return ffi::Unexpected(error);
    return static_cast<const int32_t*>(storage->data());
  }
  const int32_t* EngineIds(const IdBuffer& ids) { return ids.typed_data(); }
  ffi::Error Run(const BlockCopyRequest& request) {
    return CudaError(LaunchBlockCopy(request, stream), "block copy launch");
  }
  ffi::Error RunMany(const std::vector<BlockCopyRequest>& requests) {
    for (const BlockCopyRequest& request : requests) {
      ffi::Error error = Run(request);
      if (error.failure()) return error;
    }
    return ffi::Error::Success();
  }
  ffi::Error RunRewrite(const BlockRewriteRequest& request) {
    return CudaError(LaunchBlockRewrite(request, stream), "block rewrite launch");
  }
  ffi::Error CopyBytes(void* dst, const void* src, int64_t bytes) {
    return CudaError(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                     cudaMemcpyDeviceToDevice, stream),
                     "cache copy");
  }
  void AdviseFresh(void*, int64_t) {}
};

ffi::Error CopyBlocks(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer src_ids,
                      IdBuffer dst_ids, ffi::Result<ffi::AnyBuffer> out, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return CopyBlocksImpl(platform, cache, src_ids, dst_ids, out);
}

ffi::Error GatherBlocks(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer ids,
                        ffi::Result<ffi::AnyBuffer> out, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return GatherBlocksImpl(platform, cache, ids, out);
}

ffi::Error GatherBlocksInto(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer ids,
                            ffi::AnyBuffer into, ffi::Result<ffi::AnyBuffer> out,
                            bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return GatherBlocksIntoImpl(platform, cache, ids, into, out);
}

ffi::Error ScatterBlocks(cudaStream_t stream, ffi::AnyBuffer cache, ffi::AnyBuffer blocks,
                         IdBuffer ids, ffi::Result<ffi::AnyBuffer> out, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return ScatterBlocksImpl(platform, cache, blocks, ids, out);
}

ffi::Error RearrangeBlocks(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer ids,
                           ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::AnyBuffer> scratch,
                           std::string_view src_layout, std::string_view dst_layout,
                           int64_t ratio, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return RearrangeBlocksImpl(platform, cache, ids, out, scratch, src_layout, dst_layout, ratio);
}

ffi::Error CopyBlockPrefix(cudaStream_t stream, ffi::AnyBuffer src_cache, ffi::AnyBuffer dst_cache,
                           IdBuffer src_ids, IdBuffer dst_ids, TokenCount num_tokens,
                           ffi::Result<ffi::AnyBuffer> out, std::string_view layout,
                           bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return CopyBlockPrefixImpl(platform, src_cache, dst_cache, src_ids, dst_ids, num_tokens, out,
                             layout);
}

ffi::Error CopyBlockPrefixInPlace(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer src_ids,
                                  IdBuffer dst_ids, TokenCount num_tokens,
                                  ffi::Result<ffi::AnyBuffer> out, std::string_view layout,
                                  bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return CopyBlockPrefixInPlaceImpl(platform, cache, src_ids, dst_ids, num_tokens, out, layout);
}

ffi::Error SplitBlocks(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer ids,
                       ffi::RemainingArgs into, ffi::RemainingRets outs,
                       ffi::Span<const int64_t> box_starts, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return SplitBlocksImpl(platform, cache, ids, into, outs, box_starts);
}

ffi::Error ConcatBlocks(cudaStream_t stream, ffi::AnyBuffer cache, IdBuffer ids,
                        ffi::RemainingArgs buffers, ffi::Result<ffi::AnyBuffer> out,
                        ffi::Span<const int64_t> box_starts, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids};
  return ConcatBlocksImpl(platform, cache, ids, buffers, out, box_starts);
}

}  // namespace

// The CUDA handlers take XLA's stream first, then the same operands as on CPU.
auto BindStream() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlocksCuda_Handler, CopyBlocks, BindCopyBlocks(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherBlocksCuda_Handler, GatherBlocks,
                              BindGatherBlocks(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherBlocksIntoCuda_Handler, GatherBlocksInto,
                              BindGatherBlocksInto(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScatterBlocksCuda_Handler, ScatterBlocks,
                              BindScatterBlocks(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RearrangeBlocksCuda_Handler, RearrangeBlocks,
                              BindRearrangeBlocks(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlockPrefixCuda_Handler, CopyBlockPrefix,
                              BindCopyBlockPrefix(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlockPrefixInPlaceCuda_Handler, CopyBlockPrefixInPlace,
                              BindCopyBlockPrefixInPlace(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SplitBlocksCuda_Handler, SplitBlocks, BindSplitBlocks(BindStream()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConcatBlocksCuda_Handler, ConcatBlocks,
                              BindConcatBlocks(BindStream()));

}  // namespace jaxkv
