// Platform-independent bodies of the reshaping handlers (permute, merge, partial copy, split,
// concat). Same contract as block_ops_impl.h: everything is validated before the first write,
// and a Platform provides, besides CheckIds / CheckIdPairs / EngineIds / Run / CopyBytes:
//
//   // Scratch bytes RunRewrite needs for `request` (its path's staging, decided here).
//   xla::ffi::ErrorOr<int64_t> RewriteStagingBytes(const BlockRewriteRequest& request);
//   xla::ffi::Error RunRewrite(const BlockRewriteRequest& request);
//   // Requests over the same pairs, none writing what another reads (split, concat).
//   xla::ffi::Error RunMany(const std::vector<BlockCopyRequest>& requests);
//   void AdviseFresh(void* data, int64_t bytes);  // a fresh output (CPU: huge pages)
//
// Every op is a BlockCopyRequest or BlockRewriteRequest whose RunMap comes from
// block_index.h, so the CPU and CUDA engines share all of the index math.
#ifndef JAXKV_FFI_RESHAPE_OPS_IMPL_H_
#define JAXKV_FFI_RESHAPE_OPS_IMPL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "block_checks.h"
#include "block_index.h"
#include "block_ops_impl.h"
#include "xla/ffi/api/ffi.h"

namespace jaxkv {

using TokenCount = xla::ffi::Buffer<xla::ffi::S32, 0>;

namespace reshape_internal {

// The map builders of block_index.h run with an item size of ElementBits (so packed sub-byte
// elements are exact) and the maps are converted to bytes; a map that would split a byte
// between runs (e.g. a permute moving single int4 elements) is refused.
inline xla::ffi::Error SubByteError(std::string_view op, int64_t element_bits) {
  return xla::ffi::Error::InvalidArgument(
      std::string(op) + ": with packed " + std::to_string(element_bits) +
      "-bit elements the bytes this op moves are not whole bytes (it would move parts of a "
      "byte); make the innermost contiguous extent a multiple of " +
      std::to_string(8 / element_bits) + " elements");
}

// The per-block dimensions of a blocks-first buffer (at most kMaxRunDims of them).
inline xla::ffi::ErrorOr<std::vector<int64_t>> BlockDims(const xla::ffi::AnyBuffer& buffer,
                                                         std::string_view name) {
  const auto dims = buffer.dimensions();
  if (dims.size() < 2 || dims.size() > static_cast<size_t>(kMaxRunDims) + 1) {
    return xla::ffi::Unexpected(xla::ffi::Error::InvalidArgument(
        std::string(name) + " must be [num_blocks, *block] with 1 to " +
        std::to_string(kMaxRunDims) + " block axes"));
  }
  return std::vector<int64_t>(dims.begin() + 1, dims.end());
}

inline xla::ffi::Error MapError(std::string_view op) {
  return xla::ffi::Error::InvalidArgument(std::string(op) +
                                          ": the index mapping has too many strided axes");
}

}  // namespace reshape_internal

// In place: each listed block holds `ratio` sub-blocks arranged in `src_layout` (T / ratio
// tokens each); rewrite it in `dst_layout`, the cache's layout. ratio == 1 is a permute.
// `scratch` (a result XLA allocates) stages per-thread units on CPU (at least one block), and
// blocks on CUDA when a unit exceeds shared memory (at least one block then; none otherwise).
template <typename Platform>
xla::ffi::Error RearrangeBlocksImpl(Platform& platform, xla::ffi::AnyBuffer cache, IdBuffer ids,
                                    xla::ffi::Result<xla::ffi::AnyBuffer> out,
                                    xla::ffi::Result<xla::ffi::AnyBuffer> scratch,
                                    std::string_view src_layout, std::string_view dst_layout,
                                    int64_t ratio) {
  auto geometry = BlocksFirstGeometry(cache, "cache");
  if (!geometry) return geometry.error();
  auto dims = reshape_internal::BlockDims(cache, "cache");
  if (!dims) return dims.error();
  const int rank = static_cast<int>(dims->size());
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(cache, "cache", *out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(out->dimensions()[0], geometry->num_blocks,
                                   "blocks in the result"));
  JAXKV_RETURN_IF_ERROR(CheckLayoutPair(src_layout, dst_layout, rank));
  const int64_t tokens = (*dims)[dst_layout.find('T')];
  if (ratio < 1 || tokens % ratio != 0) {
    return xla::ffi::Error::InvalidArgument("ratio " + std::to_string(ratio) +
                                            " does not divide the block size " +
                                            std::to_string(tokens));
  }
  const int64_t count = static_cast<int64_t>(ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckIds(platform, ids, geometry->num_blocks, "ids", /*unique=*/true));
  RearrangePlan plan;
  if (!RearrangeMap(src_layout.data(), dst_layout.data(), rank, dims->data(), ratio,
                    geometry->element_bits, &plan)) {
    return reshape_internal::MapError("rearrange");
  }
  if (plan.unit_bytes % 8 != 0 || !MapBitsToBytes(&plan.map)) {
    return reshape_internal::SubByteError("rearrange", geometry->element_bits);
  }
  plan.unit_bytes /= 8;
  BlockRewriteRequest request;
  request.data = static_cast<char*>(out->untyped_data());
  request.side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(ids)};
  request.num_ids = count;
  request.units_per_block = plan.units_per_block;
  request.unit_bytes = plan.unit_bytes;
  request.map = plan.map;
  request.staging = static_cast<char*>(scratch->untyped_data());
  request.staging_bytes = BufferBytes(*scratch);
  const bool moves_nothing = count == 0 || geometry->block_bytes == 0 ||
                             (ratio == 1 && src_layout == dst_layout);
  if (!moves_nothing) {
    auto needed = platform.RewriteStagingBytes(request);
    if (!needed) return needed.error();
    if (request.staging_bytes < *needed) {
      return xla::ffi::Error::InvalidArgument(
          "scratch of " + std::to_string(request.staging_bytes) + " bytes is smaller than the " +
          std::to_string(*needed) + " bytes (one block) this rewrite stages");
    }
  }
  JAXKV_RETURN_IF_ERROR(AliasCache(platform, cache, *out));
  if (moves_nothing) return xla::ffi::Error::Success();
  return platform.RunRewrite(request);
}

// Shared by both partial-copy handlers: dst[dst_ids[i]][..., :n, ...] = src[src_ids[i]][...]
// along the token axis of `layout`, n = EffectiveRows(num_tokens, T).
template <typename Platform>
xla::ffi::Error CopyBlockPrefixCommon(Platform& platform, const xla::ffi::AnyBuffer& src,
                                      bool same_cache, IdBuffer src_ids, IdBuffer dst_ids,
                                      TokenCount num_tokens, const xla::ffi::AnyBuffer& dst,
                                      xla::ffi::AnyBuffer& out, std::string_view layout) {
  auto src_geometry = BlocksFirstGeometry(src, "src_cache");
  if (!src_geometry) return src_geometry.error();
  auto dst_geometry = BlocksFirstGeometry(dst, "dst_cache");
  if (!dst_geometry) return dst_geometry.error();
  auto dims = reshape_internal::BlockDims(dst, "dst_cache");
  if (!dims) return dims.error();
  const int rank = static_cast<int>(dims->size());
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(src, "src_cache", dst, "dst_cache"));
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(dst, "dst_cache", out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(out.dimensions()[0], dst_geometry->num_blocks,
                                   "blocks in the result"));
  JAXKV_RETURN_IF_ERROR(CheckLayout(layout, rank, "layout"));
  const int64_t count = static_cast<int64_t>(src_ids.element_count());
  JAXKV_RETURN_IF_ERROR(CheckIdPairs(platform, src_ids, src_geometry->num_blocks, dst_ids,
                                     dst_geometry->num_blocks, /*disjoint=*/same_cache));
  const int t_axis = static_cast<int>(layout.find('T'));
  RunMap map;
  int64_t row_bytes = 0;
  if (!PrefixMap(dims->data(), rank, t_axis, dst_geometry->element_bits, &map, &row_bytes)) {
    return reshape_internal::MapError("copy_block_prefix");
  }
  if (row_bytes % 8 != 0 || !MapBitsToBytes(&map)) {
    return reshape_internal::SubByteError("copy_block_prefix", dst_geometry->element_bits);
  }
  row_bytes /= 8;
  JAXKV_RETURN_IF_ERROR(AliasCache(platform, dst, out));
  if (count == 0 || dst_geometry->block_bytes == 0) return xla::ffi::Error::Success();

  BlockCopyRequest request;
  request.src = same_cache ? static_cast<const char*>(out.untyped_data())
                           : static_cast<const char*>(src.untyped_data());
  request.dst = static_cast<char*>(out.untyped_data());
  request.src_side = {src_geometry->num_blocks, src_geometry->block_bytes,
                      platform.EngineIds(src_ids)};
  request.dst_side = {dst_geometry->num_blocks, dst_geometry->block_bytes,
                      platform.EngineIds(dst_ids)};
  request.num_pairs = count;
  request.map = map;
  request.num_rows = num_tokens.typed_data();
  request.max_rows = (*dims)[t_axis];
  request.row_bytes = row_bytes;
  return platform.Run(request);
}

// Between two caches: dst_cache (aliased to the result) takes token prefixes of src_cache.
template <typename Platform>
xla::ffi::Error CopyBlockPrefixImpl(Platform& platform, xla::ffi::AnyBuffer src_cache,
                                    xla::ffi::AnyBuffer dst_cache, IdBuffer src_ids,
                                    IdBuffer dst_ids, TokenCount num_tokens,
                                    xla::ffi::Result<xla::ffi::AnyBuffer> out,
                                    std::string_view layout) {
  return CopyBlockPrefixCommon(platform, src_cache, /*same_cache=*/false, src_ids, dst_ids,
                               num_tokens, dst_cache, *out, layout);
}

// Inside one cache (copy-on-partial-reuse): sources and destinations must be disjoint.
template <typename Platform>
xla::ffi::Error CopyBlockPrefixInPlaceImpl(Platform& platform, xla::ffi::AnyBuffer cache,
                                           IdBuffer src_ids, IdBuffer dst_ids,
                                           TokenCount num_tokens,
                                           xla::ffi::Result<xla::ffi::AnyBuffer> out,
                                           std::string_view layout) {
  return CopyBlockPrefixCommon(platform, cache, /*same_cache=*/true, src_ids, dst_ids,
                               num_tokens, cache, *out, layout);
}

// Split: dense buffer i gets, for every id, the box of the block starting at
// box_starts[i * rank ...] with the buffer's per-block shape; rows of negative ids are zero.
// `into` are optional caller buffers aliased to the results (every row is written, so their
// contents do not matter).
template <typename Platform>
xla::ffi::Error SplitBlocksImpl(Platform& platform, xla::ffi::AnyBuffer cache, IdBuffer ids,
                                xla::ffi::RemainingArgs into, xla::ffi::RemainingRets outs,
                                xla::ffi::Span<const int64_t> box_starts) {
  auto geometry = BlocksFirstGeometry(cache, "cache");
  if (!geometry) return geometry.error();
  auto dims = reshape_internal::BlockDims(cache, "cache");
  if (!dims) return dims.error();
  const int64_t rank = static_cast<int64_t>(dims->size());
  const int64_t count = static_cast<int64_t>(ids.element_count());
  const int64_t num_out = static_cast<int64_t>(outs.size());
  if (!into.empty() && static_cast<int64_t>(into.size()) != num_out) {
    return xla::ffi::Error::InvalidArgument("got " + std::to_string(into.size()) +
                                            " out buffers for " + std::to_string(num_out) +
                                            " results");
  }
  JAXKV_RETURN_IF_ERROR(CheckCount(static_cast<int64_t>(box_starts.size()), num_out * rank,
                                   "box_starts entries (buffers x block axes)"));
  std::vector<xla::ffi::AnyBuffer> results;
  std::vector<int64_t> sizes(static_cast<size_t>(num_out * rank));
  std::vector<int64_t> row_bytes(static_cast<size_t>(num_out));
  for (int64_t i = 0; i < num_out; ++i) {
    auto result = outs.get<xla::ffi::AnyBuffer>(static_cast<size_t>(i));
    if (!result) return result.error();
    xla::ffi::AnyBuffer buffer = **result;
    const std::string name = "buffer " + std::to_string(i);
    const auto out_dims = buffer.dimensions();
    if (buffer.element_type() != cache.element_type() ||
        static_cast<int64_t>(out_dims.size()) != rank + 1 || out_dims[0] != count) {
      return xla::ffi::Error::InvalidArgument(
          name + " must be [num_ids, *box] with the cache's element type and rank");
    }
    auto buffer_geometry = BlocksFirstGeometry(buffer, name);
    if (!buffer_geometry) return buffer_geometry.error();
    row_bytes[i] = buffer_geometry->block_bytes;
    for (int64_t a = 0; a < rank; ++a) sizes[i * rank + a] = out_dims[a + 1];
    JAXKV_RETURN_IF_ERROR(
        CheckBox(dims->data(), box_starts.begin() + i * rank, &sizes[i * rank], rank, name));
    if (!into.empty()) {
      auto given = into.get<xla::ffi::AnyBuffer>(static_cast<size_t>(i));
      if (!given) return given.error();
      JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(*given, "out " + std::to_string(i), buffer,
                                                name));
      JAXKV_RETURN_IF_ERROR(CheckCount(given->dimensions()[0], count, "rows of out"));
    }
    results.push_back(buffer);
  }
  JAXKV_RETURN_IF_ERROR(CheckIds(platform, ids, geometry->num_blocks, "ids", /*unique=*/false));
  std::vector<RunMap> maps(static_cast<size_t>(num_out));
  for (int64_t i = 0; i < num_out; ++i) {
    if (!BoxMap(dims->data(), box_starts.begin() + i * rank, &sizes[i * rank],
                static_cast<int>(rank), geometry->element_bits, /*to_box=*/true, &maps[i])) {
      return reshape_internal::MapError("split");
    }
    if (!MapBitsToBytes(&maps[i])) {
      return reshape_internal::SubByteError("split", geometry->element_bits);
    }
  }
  if (count == 0) return xla::ffi::Error::Success();
  std::vector<BlockCopyRequest> requests;
  for (int64_t i = 0; i < num_out; ++i) {
    xla::ffi::AnyBuffer& buffer = results[i];
    if (row_bytes[i] == 0) continue;
    if (into.empty()) platform.AdviseFresh(buffer.untyped_data(), row_bytes[i] * count);
    BlockCopyRequest request;
    request.src = static_cast<const char*>(cache.untyped_data());
    request.dst = static_cast<char*>(buffer.untyped_data());
    request.src_side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(ids)};
    request.dst_side = {count, row_bytes[i], nullptr};
    request.num_pairs = count;
    request.map = maps[i];
    request.zero_fill_skipped = true;
    requests.push_back(request);
  }
  return platform.RunMany(requests);
}

// Concat, the inverse: the box of every listed block starting at box_starts[i * rank ...] takes
// row b of dense buffer i; negative ids are skipped. Boxes must not overlap.
template <typename Platform>
xla::ffi::Error ConcatBlocksImpl(Platform& platform, xla::ffi::AnyBuffer cache, IdBuffer ids,
                                 xla::ffi::RemainingArgs buffers,
                                 xla::ffi::Result<xla::ffi::AnyBuffer> out,
                                 xla::ffi::Span<const int64_t> box_starts) {
  auto geometry = BlocksFirstGeometry(cache, "cache");
  if (!geometry) return geometry.error();
  auto dims = reshape_internal::BlockDims(cache, "cache");
  if (!dims) return dims.error();
  const int64_t rank = static_cast<int64_t>(dims->size());
  const int64_t count = static_cast<int64_t>(ids.element_count());
  const int64_t num_in = static_cast<int64_t>(buffers.size());
  JAXKV_RETURN_IF_ERROR(CheckSameBlockShape(cache, "cache", *out, "result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(out->dimensions()[0], geometry->num_blocks,
                                   "blocks in the result"));
  JAXKV_RETURN_IF_ERROR(CheckCount(static_cast<int64_t>(box_starts.size()), num_in * rank,
                                   "box_starts entries (buffers x block axes)"));
  std::vector<xla::ffi::AnyBuffer> inputs;
  std::vector<int64_t> sizes(static_cast<size_t>(num_in * rank));
  std::vector<int64_t> row_bytes(static_cast<size_t>(num_in));
  for (int64_t i = 0; i < num_in; ++i) {
    auto arg = buffers.get<xla::ffi::AnyBuffer>(static_cast<size_t>(i));
    if (!arg) return arg.error();
    const std::string name = "buffer " + std::to_string(i);
    const auto in_dims = arg->dimensions();
    if (arg->element_type() != cache.element_type() ||
        static_cast<int64_t>(in_dims.size()) != rank + 1 || in_dims[0] != count) {
      return xla::ffi::Error::InvalidArgument(
          name + " must be [num_ids, *box] with the cache's element type and rank");
    }
    auto buffer_geometry = BlocksFirstGeometry(*arg, name);
    if (!buffer_geometry) return buffer_geometry.error();
    row_bytes[i] = buffer_geometry->block_bytes;
    for (int64_t a = 0; a < rank; ++a) sizes[i * rank + a] = in_dims[a + 1];
    JAXKV_RETURN_IF_ERROR(
        CheckBox(dims->data(), box_starts.begin() + i * rank, &sizes[i * rank], rank, name));
    inputs.push_back(*arg);
  }
  JAXKV_RETURN_IF_ERROR(CheckBoxesDisjoint(box_starts.begin(), sizes.data(), num_in, rank));
  JAXKV_RETURN_IF_ERROR(CheckIds(platform, ids, geometry->num_blocks, "ids", /*unique=*/true));
  std::vector<RunMap> maps(static_cast<size_t>(num_in));
  for (int64_t i = 0; i < num_in; ++i) {
    if (!BoxMap(dims->data(), box_starts.begin() + i * rank, &sizes[i * rank],
                static_cast<int>(rank), geometry->element_bits, /*to_box=*/false, &maps[i])) {
      return reshape_internal::MapError("concat");
    }
    if (!MapBitsToBytes(&maps[i])) {
      return reshape_internal::SubByteError("concat", geometry->element_bits);
    }
  }
  JAXKV_RETURN_IF_ERROR(AliasCache(platform, cache, *out));
  if (count == 0 || geometry->block_bytes == 0) return xla::ffi::Error::Success();
  std::vector<BlockCopyRequest> requests;
  for (int64_t i = 0; i < num_in; ++i) {
    const xla::ffi::AnyBuffer& buffer = inputs[i];
    if (row_bytes[i] == 0) continue;
    BlockCopyRequest request;
    request.src = static_cast<const char*>(buffer.untyped_data());
    request.dst = static_cast<char*>(out->untyped_data());
    request.src_side = {count, row_bytes[i], nullptr};
    request.dst_side = {geometry->num_blocks, geometry->block_bytes, platform.EngineIds(ids)};
    request.num_pairs = count;
    request.map = maps[i];
    requests.push_back(request);
  }
  return platform.RunMany(requests);
}

// Operand lists, shared by both platforms (see block_ops_impl.h).
template <typename Binding>
auto BindRearrangeBlocks(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // ids
      .template Ret<xla::ffi::AnyBuffer>()             // cache, aliased
      .template Ret<xla::ffi::AnyBuffer>()             // scratch
      .template Attr<std::string_view>("src_layout")
      .template Attr<std::string_view>("dst_layout")
      .template Attr<int64_t>("ratio")
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindCopyBlockPrefix(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // src_cache
      .template Arg<xla::ffi::AnyBuffer>()             // dst_cache
      .template Arg<IdBuffer>()                        // src_ids
      .template Arg<IdBuffer>()                        // dst_ids
      .template Arg<TokenCount>()                      // num_tokens
      .template Ret<xla::ffi::AnyBuffer>()             // dst_cache, aliased
      .template Attr<std::string_view>("layout")
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindCopyBlockPrefixInPlace(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // src_ids
      .template Arg<IdBuffer>()                        // dst_ids
      .template Arg<TokenCount>()                      // num_tokens
      .template Ret<xla::ffi::AnyBuffer>()             // cache, aliased
      .template Attr<std::string_view>("layout")
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindSplitBlocks(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // ids
      .RemainingArgs()                                 // optional out buffers, aliased
      .RemainingRets()                                 // one dense buffer per box
      .template Attr<xla::ffi::Span<const int64_t>>("box_starts")
      .template Attr<bool>("validate_ids");
}

template <typename Binding>
auto BindConcatBlocks(Binding binding) {
  return std::move(binding).template Arg<xla::ffi::AnyBuffer>()  // cache
      .template Arg<IdBuffer>()                        // ids
      .RemainingArgs()                                 // one dense buffer per box
      .template Ret<xla::ffi::AnyBuffer>()             // cache, aliased
      .template Attr<xla::ffi::Span<const int64_t>>("box_starts")
      .template Attr<bool>("validate_ids");
}

}  // namespace jaxkv

#endif  // JAXKV_FFI_RESHAPE_OPS_IMPL_H_
