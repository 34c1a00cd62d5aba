// CUDA FFI handlers. Ids live in device memory and no handler waits for the device: with
// `validate_ids`, the checks run as small kernels enqueued before the op's kernels (range,
// repeats with a bitmap of the buffer's blocks, overlap of an in-place copy), and a failed
// check makes the op's kernels write no cache block (a dense output comes out zero). The
// failure is recorded on the device (kId* bits of block_copy_cuda.h), where TakeIdErrors reads
// it; the handler itself returns success, since it cannot know the verdict without
// synchronising. Without `validate_ids` only the range is enforced: kernels skip ids out of
// range, so memory outside the buffers is never touched, and repeated or overlapping ids make
// the result depend on the order in which pairs run.
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

// `status` as an ffi::Error naming jaxkv's step (`what`) and the CUDA call that failed.
ffi::Error CudaError(const CudaStatus& status, const char* what) {
  if (status.ok()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxkv CUDA ") + what + ": " + status.call +
                              " failed: " + cudaGetErrorName(status.error) + ": " +
                              cudaGetErrorString(status.error));
}

struct CudaPlatform {
  cudaStream_t stream;
  bool validate_ids;
  ffi::ScratchAllocator& allocator;
  // The op's id-check verdict (device memory, zero while the ids are valid), passed to every
  // kernel of the op; null without validation.
  uint32_t* verdict = nullptr;

  ffi::ErrorOr<uint32_t*> Allocate(int64_t words) {
    auto memory = allocator.Allocate(static_cast<size_t>(words) * sizeof(uint32_t),
                                   alignof(uint32_t));
    if (!memory) {
      return ffi::Unexpected(ffi::Error::Internal("jaxkv CUDA id check: no device scratch for " +
                                                  std::to_string(words) + " words"));
    }
    return static_cast<uint32_t*>(*memory);
  }
  // Enqueues `request`'s checks, OR-ing into the op's verdict (allocated and zeroed on first
  // use, on the stream, so the op's kernels see it after the checks).
  ffi::Error EnqueueCheck(const IdCheckRequest& request) {
    if (!validate_ids || request.count == 0) return ffi::Error::Success();
    if (verdict == nullptr) {
      auto word = Allocate(1);
      if (!word) return word.error();
      JAXKV_RETURN_IF_ERROR(CudaError(
          Checked(cudaMemsetAsync(*word, 0, sizeof(uint32_t), stream), "cudaMemsetAsync"),
          "id check verdict"));
      verdict = *word;
    }
    uint32_t* bitmap = nullptr;
    if (const int64_t words = IdCheckBitmapWords(request); words > 0) {
      auto memory = Allocate(words);
      if (!memory) return memory.error();
      bitmap = *memory;
    }
    return CudaError(LaunchIdCheck(request, verdict, bitmap, stream), "id check");
  }
  ffi::Error CheckIds(const int32_t* ids, int64_t count, int64_t num_blocks, const char*,
                      bool unique) {
    IdCheckRequest request;
    request.ids = ids;
    request.count = count;
    request.num_blocks = num_blocks;
    request.unique = unique;
    return EnqueueCheck(request);
  }
  ffi::Error CheckIdPairs(const int32_t* src_ids, int64_t src_blocks, const int32_t* dst_ids,
                          int64_t dst_blocks, int64_t count, bool disjoint) {
    // The destinations are the list checked for repeats; the overlap check finds sources
    // among them.
    IdCheckRequest request;
    request.ids = dst_ids;
    request.count = count;
    request.num_blocks = dst_blocks;
    request.unique = true;
    request.other_ids = src_ids;
    request.other_blocks = src_blocks;
    request.disjoint = disjoint;
    return EnqueueCheck(request);
  }
  const int32_t* EngineIds(const IdBuffer& ids) { return ids.typed_data(); }
  ffi::Error Run(const BlockCopyRequest& request) {
    return CudaError(LaunchBlockCopy(request, verdict, stream), "block copy");
  }
  ffi::Error RunMany(const std::vector<BlockCopyRequest>& requests) {
    for (const BlockCopyRequest& request : requests) {
      ffi::Error error = Run(request);
      if (error.failure()) return error;
    }
    return ffi::Error::Success();
  }
  ffi::ErrorOr<int64_t> RewriteStagingBytes(const BlockRewriteRequest& request) {
    int64_t bytes = 0;
    ffi::Error error = CudaError(jaxkv::RewriteStagingBytes(request, &bytes), "block rewrite");
    if (error.failure()) return ffi::Unexpected(error);
    return bytes;
  }
  ffi::Error RunRewrite(const BlockRewriteRequest& request) {
    return CudaError(LaunchBlockRewrite(request, verdict, stream), "block rewrite");
  }
  ffi::Error CopyBytes(void* dst, const void* src, int64_t bytes) {
    return CudaError(Checked(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes),
                                             cudaMemcpyDeviceToDevice, stream),
                             "cudaMemcpyAsync"),
                     "cache copy");
  }
  void AdviseFresh(void*, int64_t) {}
};

// Every handler takes XLA's stream and a scratch allocator, then the operands of its CPU twin.
ffi::Error CopyBlocks(cudaStream_t stream, ffi::ScratchAllocator allocator, ffi::AnyBuffer cache,
                      IdBuffer src_ids, IdBuffer dst_ids, ffi::Result<ffi::AnyBuffer> out,
                      bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return CopyBlocksImpl(platform, cache, src_ids, dst_ids, out);
}

ffi::Error GatherBlocks(cudaStream_t stream, ffi::ScratchAllocator allocator,
                        ffi::AnyBuffer cache, IdBuffer ids, ffi::Result<ffi::AnyBuffer> out,
                        bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return GatherBlocksImpl(platform, cache, ids, out);
}

ffi::Error GatherBlocksInto(cudaStream_t stream, ffi::ScratchAllocator allocator,
                            ffi::AnyBuffer cache, IdBuffer ids, ffi::AnyBuffer into,
                            ffi::Result<ffi::AnyBuffer> out, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return GatherBlocksIntoImpl(platform, cache, ids, into, out);
}

ffi::Error ScatterBlocks(cudaStream_t stream, ffi::ScratchAllocator allocator,
                         ffi::AnyBuffer cache, ffi::AnyBuffer blocks, IdBuffer ids,
                         ffi::Result<ffi::AnyBuffer> out, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return ScatterBlocksImpl(platform, cache, blocks, ids, out);
}

ffi::Error RearrangeBlocks(cudaStream_t stream, ffi::ScratchAllocator allocator,
                           ffi::AnyBuffer cache, IdBuffer ids, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> scratch, std::string_view src_layout,
                           std::string_view dst_layout, int64_t ratio, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return RearrangeBlocksImpl(platform, cache, ids, out, scratch, src_layout, dst_layout, ratio);
}

ffi::Error CopyBlockPrefix(cudaStream_t stream, ffi::ScratchAllocator allocator,
                           ffi::AnyBuffer src_cache, ffi::AnyBuffer dst_cache, IdBuffer src_ids,
                           IdBuffer dst_ids, TokenCount num_tokens,
                           ffi::Result<ffi::AnyBuffer> out, std::string_view layout,
                           bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return CopyBlockPrefixImpl(platform, src_cache, dst_cache, src_ids, dst_ids, num_tokens, out,
                             layout);
}

ffi::Error CopyBlockPrefixInPlace(cudaStream_t stream, ffi::ScratchAllocator allocator,
                                  ffi::AnyBuffer cache, IdBuffer src_ids, IdBuffer dst_ids,
                                  TokenCount num_tokens, ffi::Result<ffi::AnyBuffer> out,
                                  std::string_view layout, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return CopyBlockPrefixInPlaceImpl(platform, cache, src_ids, dst_ids, num_tokens, out, layout);
}

ffi::Error SplitBlocks(cudaStream_t stream, ffi::ScratchAllocator allocator, ffi::AnyBuffer cache,
                       IdBuffer ids, ffi::RemainingArgs into, ffi::RemainingRets outs,
                       ffi::Span<const int64_t> box_starts, bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return SplitBlocksImpl(platform, cache, ids, into, outs, box_starts);
}

ffi::Error ConcatBlocks(cudaStream_t stream, ffi::ScratchAllocator allocator,
                        ffi::AnyBuffer cache, IdBuffer ids, ffi::RemainingArgs buffers,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> box_starts,
                        bool validate_ids) {
  CudaPlatform platform{stream, validate_ids, allocator};
  return ConcatBlocksImpl(platform, cache, ids, buffers, out, box_starts);
}

}  // namespace

// The CUDA handlers take XLA's stream and a scratch allocator first, then the same operands
// as on CPU. The scratch (the id checks' verdict and bitmap) is returned to XLA's allocator
// when the handler returns, before the kernels using it ran: XLA hands it out again only to
// work ordered after them on the stream, as for jaxlib's own GPU kernels' workspaces.
auto BindStream() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::ScratchAllocator>();
}

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
