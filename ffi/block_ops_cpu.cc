// CPU FFI handlers: ids live in host memory, so they are always validated.
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_copy_cpu.h"
#include "block_ops.h"
#include "block_ops_impl.h"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {
namespace {

namespace ffi = xla::ffi;

struct CpuPlatform {
  ffi::ErrorOr<const int32_t*> HostIds(const IdBuffer& ids, std::vector<int32_t>*) {
    return ids.typed_data();
  }
  const int32_t* EngineIds(const IdBuffer& ids) { return ids.typed_data(); }
  ffi::Error Run(const BlockCopyRequest& request) {
    CopyBlocksCpu(request);
    return ffi::Error::Success();
  }
  ffi::Error CopyBytes(void* dst, const void* src, int64_t bytes) {
    std::memcpy(dst, src, static_cast<size_t>(bytes));
    return ffi::Error::Success();
  }
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
  AdviseFreshOutput(out->untyped_data(), static_cast<int64_t>(out->size_bytes()));
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

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CopyBlocksCpu_Handler, CopyBlocks,
                              BindCopyBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherBlocksCpu_Handler, GatherBlocks,
                              BindGatherBlocks(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherBlocksIntoCpu_Handler, GatherBlocksInto,
                              BindGatherBlocksInto(ffi::Ffi::Bind()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(ScatterBlocksCpu_Handler, ScatterBlocks,
                              BindScatterBlocks(ffi::Ffi::Bind()));

}  // namespace jaxkv
