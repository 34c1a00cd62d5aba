// CPU FFI handlers: ids live in host memory, so they are always validated.
#include <cstdint>
#include <cstring>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include "block_copy_cpu.h"
#include "block_ops.h"
#include "block_ops_impl.h"
#include "reshape_ops_impl.h"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {
namespace {

namespace ffi = xla::ffi;

// Runs `fn`, turning an exception (the thread pool's allocations can throw) into an error:
// nothing may unwind through XLA's C API.
template <typename Fn>
ffi::Error Guarded(Fn fn) {
  try {
    fn();
    return ffi::Error::Success();
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string("jaxkv CPU engine: ") + e.what());
  } catch (...) {
    return ffi::Error::Internal("jaxkv CPU engine: unknown exception");
  }
}

struct CpuPlatform {
  ffi::Error CheckIds(const int32_t* ids, int64_t count, int64_t num_blocks, const char* name,
                      bool unique) {
    return HostCheckIds(ids, count, num_blocks, name, unique);
  }
  ffi::Error CheckIdPairs(const int32_t* src_ids, int64_t src_blocks, const int32_t* dst_ids,
                          int64_t dst_blocks, int64_t count, bool disjoint) {
    return HostCheckIdPairs(src_ids, src_blocks, dst_ids, dst_blocks, count, disjoint);
  }
  const int32_t* EngineIds(const IdBuffer& ids) { return ids.typed_data(); }
  ffi::Error Run(const BlockCopyRequest& request) {
    return Guarded([&] { CopyBlocksCpu(request); });
  }
  // The engine stages one unit per thread; requiring a whole block is the contract callers
  // have always sized scratch for (the Python side allocates at least one block).
  ffi::ErrorOr<int64_t> RewriteStagingBytes(const BlockRewriteRequest& request) {
    return request.units_per_block * request.unit_bytes;
  }
  ffi::Error RunRewrite(const BlockRewriteRequest& request) {
    return Guarded([&] { RewriteBlocksCpu(request); });
  }
  ffi::Error RunMany(const std::vector<BlockCopyRequest>& requests) {
    return Guarded(
        [&] { CopyBlocksCpu(requests.data(), static_cast<int64_t>(requests.size())); });
  }
  ffi::Error CopyBytes(void* dst, const void* src, int64_t bytes) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return ffi::Error::Success();
  }
  void AdviseFresh(void* data, int64_t bytes) { AdviseFreshOutput(data, bytes); }
};

// `validate_ids` is accepted for signature parity with CUDA; on CPU the ids are already in
// host memory, so they are always validated.
ffi::Error CopyBlocks(ffi::AnyBuffer cache, IdBuffer src_ids, IdBuffer dst_ids,
                      ffi::Result<ffi::AnyBuffer> out, bool /*validate_ids*/) {
  CpuPlatform platform;
  return CopyBlocksImpl(platform, cache, src_ids, dst_ids, out);
}

ffi::Error GatherBlocks(ffi::AnyBuffer cache, IdBuffer ids, ffi::Result<ffi::AnyBuffer> out,
                        bool /*validate_ids*/) {
  // XLA allocated `out` for this call and nothing has touched it yet.
  AdviseFreshOutput(out->untyped_data(), BufferBytes(*out));
  CpuPlatform platform;
  return GatherBlocksImpl(platform, cache, ids, out);
}

ffi::Error GatherBlocksInto(ffi::AnyBuffer cache, IdBuffer ids, ffi::AnyBuffer into,
                            ffi::Result<ffi::AnyBuffer> out, bool /*validate_ids*/) {
  CpuPlatform platform;
  return GatherBlocksIntoImpl(platform, cache, ids, into, out);
}

ffi::Error ScatterBlocks(ffi::AnyBuffer cache, ffi::AnyBuffer blocks, IdBuffer ids,
                         ffi::Result<ffi::AnyBuffer> out, bool /*validate_ids*/) {
  CpuPlatform platform;
  return ScatterBlocksImpl(platform, cache, blocks, ids, out);
}

ffi::Error RearrangeBlocks(ffi::AnyBuffer cache, IdBuffer ids, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> scratch, std::string_view src_layout,
                           std::string_view dst_layout, int64_t ratio, bool /*validate_ids*/) {
  CpuPlatform platform;
  return RearrangeBlocksImpl(platform, cache, ids, out, scratch, src_layout, dst_layout, ratio);
}

ffi::Error CopyBlockPrefix(ffi::AnyBuffer src_cache, ffi::AnyBuffer dst_cache, IdBuffer src_ids,
                           IdBuffer dst_ids, TokenCount num_tokens,
                           ffi::Result<ffi::AnyBuffer> out, std::string_view layout,
                           bool /*validate_ids*/) {
  CpuPlatform platform;
  return CopyBlockPrefixImpl(platform, src_cache, dst_cache, src_ids, dst_ids, num_tokens, out,
                             layout);
}

ffi::Error CopyBlockPrefixInPlace(ffi::AnyBuffer cache, IdBuffer src_ids, IdBuffer dst_ids,
                                  TokenCount num_tokens, ffi::Result<ffi::AnyBuffer> out,
                                  std::string_view layout, bool /*validate_ids*/) {
  CpuPlatform platform;
  return CopyBlockPrefixInPlaceImpl(platform, cache, src_ids, dst_ids, num_tokens, out, layout);
}

ffi::Error SplitBlocks(ffi::AnyBuffer cache, IdBuffer ids, ffi::RemainingArgs into,
                       ffi::RemainingRets outs, ffi::Span<const int64_t> box_starts,
                       bool /*validate_ids*/) {
  CpuPlatform platform;
  return SplitBlocksImpl(platform, cache, ids, into, outs, box_starts);
}

ffi::Error ConcatBlocks(ffi::AnyBuffer cache, IdBuffer ids, ffi::RemainingArgs buffers,
                        ffi::Result<ffi::AnyBuffer> out, ffi::Span<const int64_t> box_starts,
                        bool /*validate_ids*/) {
  CpuPlatform platform;
  return ConcatBlocksImpl(platform, cache, ids, buffers, out, box_starts);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlocksCpu_Handler, CopyBlocks,
                              BindCopyBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherBlocksCpu_Handler, GatherBlocks,
                              BindGatherBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherBlocksIntoCpu_Handler, GatherBlocksInto,
                              BindGatherBlocksInto(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScatterBlocksCpu_Handler, ScatterBlocks,
                              BindScatterBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(RearrangeBlocksCpu_Handler, RearrangeBlocks,
                              BindRearrangeBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlockPrefixCpu_Handler, CopyBlockPrefix,
                              BindCopyBlockPrefix(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlockPrefixInPlaceCpu_Handler, CopyBlockPrefixInPlace,
                              BindCopyBlockPrefixInPlace(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(SplitBlocksCpu_Handler, SplitBlocks,
                              BindSplitBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ConcatBlocksCpu_Handler, ConcatBlocks,
                              BindConcatBlocks(ffi::Ffi::Bind()));

}  // namespace jaxkv
