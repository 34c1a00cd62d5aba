// Platform-independent bodies of the block-op handlers. A Platform provides:
//
//   // The id checks of CheckIds / CheckIdPairs below (the lengths already checked). The CPU
//   // runs them on the host (HostCheckIds / HostCheckIdPairs) and returns their error; the
//   // CUDA platform enqueues them on the device, where a failed check makes the op's kernels
//   // write nothing (block_ops_cuda.cc), since no custom call may wait for the device.
//   xla::ffi::Error CheckIds(const int32_t* ids, int64_t count, int64_t num_blocks,
//                            const char* name, bool unique);
//   xla::ffi::Error CheckIdPairs(const int32_t* src_ids, int64_t src_blocks,
//                                const int32_t* dst_ids, int64_t dst_blocks, int64_t count,
//                                bool disjoint);
//   // Pointer to the ids that the engine reads.
//   const int32_t* EngineIds(const IdBuffer& ids);
//   xla::ffi::Error Run(const BlockCopyRequest& request);
//   xla::ffi::Error CopyBytes(void* dst, const void* src, int64_t bytes);
//
// Each handler validates everything first and writes nothing when it returns an error.
#ifndef JAXKV_FFI_BLOCK_OPS_IMPL_H_
#define JAXKV_FFI_BLOCK_OPS_IMPL_H_

#include <cstdint>
#include <utility>

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

// The host checks of one id list against a buffer of `num_blocks` blocks: every id in range,
// and with `unique` no id repeated (the list names blocks that are written).
inline xla::ffi::Error HostCheckIds(const int32_t* ids, int64_t count, int64_t num_blocks,
                                    const char* name, bool unique) {
  JAXKV_RETURN_IF_ERROR(CheckIdsInRange(ids, count, num_blocks, name));
  if (unique) JAXKV_RETURN_IF_ERROR(CheckIdsUnique(ids, count, name));
  return xla::ffi::Error::Success();
}

// The host checks of `count` (src_ids[i], dst_ids[i]) pairs: ids in range, unique
// destinations, and with `disjoint` no block both a source and a destination.
inline xla::ffi::Error HostCheckIdPairs(const int32_t* src_ids, int64_t src_blocks,
                                        const int32_t* dst_ids, int64_t dst_blocks,
                                        int64_t count, bool disjoint) {
  JAXKV_RETURN_IF_ERROR(CheckIdsInRange(src_ids, count, src_blocks, "src_ids"));
  JAXKV_RETURN_IF_ERROR(CheckIdsInRange(dst_ids, count, dst_blocks, "dst_ids"));
  JAXKV_RETURN_IF_ERROR(CheckIdsUnique(dst_ids, count, "dst_ids"));
  if (disjoint) {
    JAXKV_RETURN_IF_ERROR(CheckIdsDisjoint(src_ids, "src_ids", dst_ids, "dst_ids", count));
  }
  return xla::ffi::Error::Success();
}

// Validates one id list against a buffer of `num_blocks` blocks (see HostCheckIds), on the
// platform's side (see the Platform interface above).
template <typename Platform>
xla::ffi::Error CheckIds(Platform& platform, const IdBuffer& ids, int64_t num_blocks,
                         const char* name, bool unique) {
  return platform.CheckIds(ids.typed_data(), static_cast<int64_t>(ids.element_count()),
                           num_blocks, name, unique);
}

// Validates the (src_ids[i], dst_ids[i]) pairs of a copy between buffers of `src_blocks` and
// `dst_blocks` blocks: equal lengths here, the ids on the platform's side (see
// HostCheckIdPairs). `disjoint`: both sides are one buffer updated in place.
template <typename Platform>
xla::ffi::Error CheckIdPairs(Platform& platform, const IdBuffer& src_ids, int64_t src_blocks,
                             const IdBuffer& dst_ids, int64_t dst_blocks, bool disjoint) {
  const int64_t count = static_cast<int64_t>(src_ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckCount(static_cast<int64_t>(dst_ids.element_count()), count,
                                   "number of dst_ids (must equal the number of src_ids)"));
  return platform.CheckIdPairs(src_ids.typed_data(), src_blocks, dst_ids.typed_data(),
                               dst_blocks, count, disjoint);
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
