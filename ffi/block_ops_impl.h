// Platform-independent bodies of the block-op handlers. A Platform provides:
//
//   // Host copy of the ids, or nullptr when validation is disabled on this platform.
//   xla::ffi::ErrorOr<const int32_t*> HostIds(const IdBuffer& ids, std::vector<int32_t>* storage);
//   // Device-visible pointer to the ids (what the engine reads).
//   const int32_t* EngineIds(const IdBuffer& ids);
//   xla::ffi::Error Run(const BlockCopyRequest& request);
//   xla::ffi::Error CopyBytes(void* dst, const void* src, int64_t bytes);
//
// Each handler validates everything first and writes nothing when it returns an error.
#ifndef JAXKV_FFI_BLOCK_OPS_IMPL_H_
#define JAXKV_FFI_BLOCK_OPS_IMPL_H_

#include <cstdint>
#include <utility>
#include <vector>

#include "block_checks.h"
#include "block_index.h"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

using IdBuffer = xla::ffi::Buffer<xla::ffi::S32, 1>;

#define JAXKV_RETURN_IF_ERROR(expr)              \
  do {                                           \
    xla::ffi::Error jaxkv_error_ = (expr);       \
    if (jaxkv_error_.failure()) return jaxkv_error_; \
  } while (0)

// An in-place op's result aliases its cache operand. Should XLA ever hand the handler two
// distinct buffers, carry the untouched blocks over before updating the result.
template <typename Platform>
xla::ffi::Error AliasCache(Platform& platform, const xla::ffi::AnyBuffer& cache,
                           xla::ffi::AnyBuffer& out) {
  if (out.untyped_data() == cache.untyped_data()) return xla::ffi::Error::Success();
  // BufferBytes, not size_bytes(): the latter counts a byte per packed sub-byte element.
  return platform.CopyBytes(out.untyped_data(), cache.untyped_data(), BufferBytes(cache));
}

// Validates one id list against a buffer of `num_blocks` blocks where the platform exposes ids
// on the host (always on CPU; on CUDA with validate_ids): every id in range, and with `unique`
// no id repeated (the list names blocks that are written).
template <typename Platform>
xla::ffi::Error CheckIds(Platform& platform, const IdBuffer& ids, int64_t num_blocks,
                         const char* name, bool unique) {
  std::vector<int32_t> storage;
  auto host = platform.HostIds(ids, &storage);
  if (!host) return host.error();
  if (*host == nullptr) return xla::ffi::Error::Success();
  const int64_t count = static_cast<int64_t>(ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckIdsInRange(*host, count, num_blocks, name));
  if (unique) JAXKV_RETURN_IF_ERROR(CheckIdsUnique(*host, count, name));
  return xla::ffi::Error::Success();
}

// Validates the (src_ids[i], dst_ids[i]) pairs of a copy between buffers of `src_blocks` and
// `dst_blocks` blocks: equal lengths, ids in range, unique destinations, and with `disjoint`
// (both sides are one buffer updated in place) no block both a source and a destination.
template <typename Platform>
xla::ffi::Error CheckIdPairs(Platform& platform, const IdBuffer& src_ids, int64_t src_blocks,
                             const IdBuffer& dst_ids, int64_t dst_blocks, bool disjoint) {
  const int64_t count = static_cast<int64_t>(src_ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckCount(static_cast<int64_t>(dst_ids.element_count()), count,
                                   "number of dst_ids (must equal the number of src_ids)"));
  std::vector<int32_t> src_storage;
  std::vector<int32_t> dst_storage;
  auto src_host = platform.HostIds(src_ids, &src_storage);
  if (!src_host) return src_host.error();
  auto dst_host = platform.HostIds(dst_ids, &dst_storage);
  if (!dst_host) return dst_host.error();
  if (*src_host == nullptr || *dst_host == nullptr) return xla::ffi::Error::Success();
  JAXKV_RETURN_IF_ERROR(CheckIdsInRange(*src_host, count, src_blocks, "src_ids"));
  JAXKV_RETURN_IF_ERROR(CheckIdsInRange(*dst_host, count, dst_blocks, "dst_ids"));
  JAXKV_RETURN_IF_ERROR(CheckIdsUnique(*dst_host, count, "dst_ids"));
  if (disjoint) {
    JAXKV_RETURN_IF_ERROR(CheckIdsDisjoint(*src_host, "src_ids", *dst_host, "dst_ids", count));
  }
  return xla::ffi::Error::Success();
}

// cache[dst_ids[i]] = cache[src_ids[i]] for every pair whose ids are both non-negative.
template <typename Platform>
xla::ffi::Error CopyBlocksImpl(Platform& platform, xla::ffi::AnyBuffer cache,
                               IdBuffer src_ids, IdBuffer dst_ids,
                               xla::ffi::Result<xla::ffi::AnyBuffer> out) {
  auto geometry = BlocksFirstGeometry(cache, "cache");
  if (!geometry) return geometry.error();
  const int64_t count = static_cast<int64_t>(src_ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(cache, "cache", *out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(out->dimensions()[0], geometry->num_blocks,
                                   "blocks in the result"));
  JAXKV_RETURN_IF_ERROR(CheckIdPairs(platform, src_ids, geometry->num_blocks, dst_ids,
                                     geometry->num_blocks, /*disjoint=*/true));
  JAXKV_RETURN_IF_ERROR(AliasCache(platform, cache, *out));
  if (count == 0 || geometry->block_bytes == 0) return xla::ffi::Error::Success();

  BlockCopyRequest request;
  request.src = static_cast<const char*>(out->untyped_data());
  request.dst = static_cast<char*>(out->untyped_data());
  request.src_side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(src_ids)};
  request.dst_side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(dst_ids)};
  request.num_pairs = count;
  request.map = IdentityRunMap(geometry->block_bytes);
  return platform.Run(request);
}

// out[i] = cache[ids[i]]; rows whose id is negative are zero-filled.
template <typename Platform>
xla::ffi::Error GatherBlocksImpl(Platform& platform, xla::ffi::AnyBuffer cache, IdBuffer ids,
                                 xla::ffi::Result<xla::ffi::AnyBuffer> out) {
  auto geometry = BlocksFirstGeometry(cache, "cache");
  if (!geometry) return geometry.error();
  const int64_t count = static_cast<int64_t>(ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(cache, "cache", *out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(out->dimensions()[0], count, "rows in the result"));
  JAXKV_RETURN_IF_ERROR(CheckIds(platform, ids, geometry->num_blocks, "ids", /*unique=*/false));
  if (count == 0 || geometry->block_bytes == 0) return xla::ffi::Error::Success();

  BlockCopyRequest request;
  request.src = static_cast<const char*>(cache.untyped_data());
  request.dst = static_cast<char*>(out->untyped_data());
  request.src_side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(ids)};
  request.dst_side = {count, geometry->block_bytes, nullptr};
  request.num_pairs = count;
  request.map = IdentityRunMap(geometry->block_bytes);
  request.zero_fill_skipped = true;
  return platform.Run(request);
}

// GatherBlocksImpl writing into a caller-provided buffer (`into`, aliased to the result, so a
// staging buffer is reused instead of allocated per call). Every row is written: copied, or
// zero-filled for a negative id.
template <typename Platform>
xla::ffi::Error GatherBlocksIntoImpl(Platform& platform, xla::ffi::AnyBuffer cache, IdBuffer ids,
                                     xla::ffi::AnyBuffer into,
                                     xla::ffi::Result<xla::ffi::AnyBuffer> out) {
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(into, "out", *out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(into.dimensions()[0], out->dimensions()[0], "rows of out"));
  return GatherBlocksImpl(platform, cache, ids, out);
}

// cache[ids[i]] = blocks[i] for every non-negative id.
template <typename Platform>
xla::ffi::Error ScatterBlocksImpl(Platform& platform, xla::ffi::AnyBuffer cache,
                                  xla::ffi::AnyBuffer blocks, IdBuffer ids,
                                  xla::ffi::Result<xla::ffi::AnyBuffer> out) {
  auto geometry = BlocksFirstGeometry(cache, "cache");
  if (!geometry) return geometry.error();
  const int64_t count = static_cast<int64_t>(ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(cache, "cache", blocks, "blocks"));
  JAXKV_RETURN_IF_ERROR(CheckCount(blocks.dimensions()[0], count,
                                   "rows of blocks (must equal the number of ids)"));
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(cache, "cache", *out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(out->dimensions()[0], geometry->num_blocks,
                                   "blocks in the result"));
  JAXKV_RETURN_IF_ERROR(CheckIds(platform, ids, geometry->num_blocks, "ids", /*unique=*/true));
  JAXKV_RETURN_IF_ERROR(AliasCache(platform, cache, *out));
  if (count == 0 || geometry->block_bytes == 0) return xla::ffi::Error::Success();

  BlockCopyRequest request;
  request.src = static_cast<const char*>(blocks.untyped_data());
  request.dst = static_cast<char*>(out->untyped_data());
  request.src_side = {count, geometry->block_bytes, nullptr};
  request.dst_side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(ids)};
  request.num_pairs = count;
  request.map = IdentityRunMap(geometry->block_bytes);
  return platform.Run(request);
}

// Operand lists of the handlers, shared by both platforms so that their signatures cannot
// drift: each takes a binding (with any platform context already bound) and adds the buffers
// and attributes of one op.
template <typename Binding>
auto BindCopyBlocks(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // src_ids
      .template Arg<IdBuffer>()                        // dst_ids
      .template Ret<xla::ffi::AnyBuffer>()             // cache, aliased
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindGatherBlocks(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // ids
      .template Ret<xla::ffi::AnyBuffer>()             // dense blocks
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindGatherBlocksInto(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // ids
      .template Arg<xla::ffi::AnyBuffer>()             // out buffer, donated
      .template Ret<xla::ffi::AnyBuffer>()             // dense blocks, aliased to it
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindScatterBlocks(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<xla::ffi::AnyBuffer>()             // dense blocks
      .template Arg<IdBuffer>()                        // ids
      .template Ret<xla::ffi::AnyBuffer>()             // cache, aliased
      .template Attr<bool>("validate_ids");
}

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_OPS_IMPL_H_
