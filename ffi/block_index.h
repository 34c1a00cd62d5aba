// Index math shared by the CPU and CUDA block-copy engines.
//
// Every jaxkv block operation is a list of (source block, destination block) pairs plus one
// `RunMap` that says how the bytes of a source block land in its destination block. A RunMap
// is a strided iteration over up to kMaxRunDims outer axes; each iteration moves one
// contiguous run of `run_bytes`. A plain block copy is the identity map: no outer axes and a
// single run of the whole block. The reshaping ops are other maps, built here from layouts:
//
//   * permute / merge (`RearrangeMap`): a block whose bytes arrived as `ratio` sub-blocks in one
//     layout is rewritten, in place, in another (a `BlockRewriteRequest`, staged unit by unit);
//   * split / concat (`BoxMap`): a box of a block (a layer range x head range) to or from a dense
//     buffer block;
//   * partial copy (`PrefixMap`): the first rows of the token axis, with the row count a runtime
//     value (`BlockCopyRequest::num_rows`).
//
// This header holds no platform code, so the CPU and CUDA engines cannot disagree about which
// byte goes where or which ids are skipped.
#ifndef JAXKV_FFI_BLOCK_INDEX_H_
#define JAXKV_FFI_BLOCK_INDEX_H_

#include <cstdint>

#if defined(__CUDACC__)
#define JAXKV_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define JAXKV_HOST_DEVICE inline
#endif

namespace jaxkv {

inline constexpr int kMaxRunDims = 8;

// How the bytes of one source block map onto one destination block.
struct RunMap {
  int32_t ndim = 0;                       // number of outer axes, <= kMaxRunDims
  int64_t sizes[kMaxRunDims] = {};        // extent of each outer axis
  int64_t src_strides[kMaxRunDims] = {};  // byte stride of each axis in the source block
  int64_t dst_strides[kMaxRunDims] = {};  // byte stride of each axis in the destination block
  int64_t run_bytes = 0;                  // contiguous bytes moved per iteration
  int64_t src_offset = 0;                 // byte offset of the first run in the source block
  int64_t dst_offset = 0;                 // byte offset of the first run in the destination

  JAXKV_HOST_DEVICE int64_t num_runs() const {
    int64_t n = 1;
    for (int32_t i = 0; i < ndim; ++i) n *= sizes[i];
    return n;
  }

  // Byte offsets, inside the source and destination blocks, of run number `run`
  // (row-major over the outer axes, last axis fastest). `Index` may be a 32-bit type when
  // num_runs() fits (much cheaper divisions on a GPU).
  template <typename Index = int64_t>
  JAXKV_HOST_DEVICE void RunOffsets(Index run, int64_t* src_offset_out,
                                    int64_t* dst_offset_out) const {
    int64_t src = src_offset;
    int64_t dst = dst_offset;
    for (int32_t i = ndim - 1; i >= 0; --i) {
      const Index size = static_cast<Index>(sizes[i]);
      const Index index = run % size;
      run /= size;
      src += static_cast<int64_t>(index) * src_strides[i];
      dst += static_cast<int64_t>(index) * dst_strides[i];
    }
    *src_offset_out = src;
    *dst_offset_out = dst;
  }
};

// The identity map: a whole block of `block_bytes` copied as one run.
JAXKV_HOST_DEVICE RunMap IdentityRunMap(int64_t block_bytes) {
  RunMap map;
  map.ndim = 0;
  map.run_bytes = block_bytes;
  return map;
}

// One side (source or destination) of a block-pair copy. `ids == nullptr` means the side is a
// dense buffer addressed by pair index (pair i is block i), as for the output of a gather.
struct BlockSide {
  int64_t num_blocks = 0;    // blocks in the buffer
  int64_t block_stride = 0;  // bytes between consecutive blocks
  const int32_t* ids = nullptr;
};

// The block id that pair `pair` uses on one side, or -1 when the pair must be skipped:
// negative ids are padding, and ids at or beyond `num_blocks` are never dereferenced.
JAXKV_HOST_DEVICE int64_t ResolveBlock(const BlockSide& side, int64_t pair) {
  const int64_t id = side.ids == nullptr ? pair : static_cast<int64_t>(side.ids[pair]);
  return (id >= 0 && id < side.num_blocks) ? id : -1;
}

// Byte offset of block `block` inside its buffer.
JAXKV_HOST_DEVICE int64_t BlockOffset(const BlockSide& side, int64_t block) {
  return block * side.block_stride;
}

// Rows a partial copy moves when asked for `requested` of `max_rows`: anything outside
// 1..max_rows-1 means the whole extent (TensorRT-LLM's kvCacheBlockPartialCopy contract).
JAXKV_HOST_DEVICE int64_t EffectiveRows(int64_t requested, int64_t max_rows) {
  return (requested <= 0 || requested >= max_rows) ? max_rows : requested;
}

// A complete block-pair copy request, the same for both engines.
struct BlockCopyRequest {
  const char* src = nullptr;
  char* dst = nullptr;
  BlockSide src_side;
  BlockSide dst_side;
  int64_t num_pairs = 0;
  RunMap map;
  // When the source id of a pair is skipped but its destination is valid, zero the whole
  // destination block (used by gather so that padded rows are deterministic).
  bool zero_fill_skipped = false;
  // Runtime run length (partial copies): when `num_rows` is set, every run moves
  // EffectiveRows(*num_rows, max_rows) * row_bytes bytes instead of map.run_bytes
  // (== max_rows * row_bytes). `num_rows` lives where the engine's ids live (host or device).
  const int32_t* num_rows = nullptr;
  int64_t max_rows = 0;
  int64_t row_bytes = 0;
};

// An in-place rewrite of listed blocks (permute, merge): each block holds `units_per_block`
// contiguous units of `unit_bytes`; every unit is staged (copied aside) and then written back
// through `map`, whose source is the staged copy and whose destination is the unit itself.
// `staging` holds `staging_bytes` of scratch memory (at least one unit).
struct BlockRewriteRequest {
  char* data = nullptr;
  BlockSide side;
  int64_t num_ids = 0;
  int64_t units_per_block = 1;
  int64_t unit_bytes = 0;
  RunMap map;
  char* staging = nullptr;
  int64_t staging_bytes = 0;
};

// A map built in bits (item size = bits per element, for packed sub-byte types) converted to
// bytes: false unless every run, stride and offset is a whole number of bytes.
inline bool MapBitsToBytes(RunMap* map) {
  if (map->run_bytes % 8 != 0 || map->src_offset % 8 != 0 || map->dst_offset % 8 != 0) {
    return false;
  }
  for (int32_t i = 0; i < map->ndim; ++i) {
    if (map->src_strides[i] % 8 != 0 || map->dst_strides[i] % 8 != 0) return false;
  }
  map->run_bytes /= 8;
  map->src_offset /= 8;
  map->dst_offset /= 8;
  for (int32_t i = 0; i < map->ndim; ++i) {
    map->src_strides[i] /= 8;
    map->dst_strides[i] /= 8;
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// Map builders (host code). They assume validated input (see block_checks.h) and report only
// whether the result fits a RunMap.

// One axis of an index space: its extent and its byte stride on each side.
struct MapAxis {
  int64_t size = 1;
  int64_t src_stride = 0;
  int64_t dst_stride = 0;
};

// Builds the RunMap that moves every element of the index space `axes` (any order), whose
// innermost `run_bytes` are contiguous on both sides. Axes are ordered by destination stride
// (writes stay sequential), merged where they are contiguous on both sides, and folded into
// the run when they continue it. Returns false if more than kMaxRunDims axes remain.
inline bool BuildRunMap(const MapAxis* axes, int count, int64_t run_bytes, int64_t src_offset,
                        int64_t dst_offset, RunMap* map) {
  MapAxis sorted[2 * kMaxRunDims];
  int n = 0;
  for (int i = 0; i < count; ++i) {
    if (axes[i].size == 1) continue;
    if (n == 2 * kMaxRunDims) return false;
    // Insertion sort: larger destination strides first; ties by source stride.
    int at = n++;
    while (at > 0 && (sorted[at - 1].dst_stride < axes[i].dst_stride ||
                      (sorted[at - 1].dst_stride == axes[i].dst_stride &&
                       sorted[at - 1].src_stride < axes[i].src_stride))) {
      sorted[at] = sorted[at - 1];
      --at;
    }
    sorted[at] = axes[i];
  }
  // Merge an axis into its inner neighbour where both sides are contiguous across them.
  int m = 0;
  for (int i = 0; i < n; ++i) {
    if (m > 0) {
      MapAxis& outer = sorted[m - 1];
      const MapAxis& inner = sorted[i];
      if (outer.src_stride == inner.size * inner.src_stride &&
          outer.dst_stride == inner.size * inner.dst_stride) {
        outer.size *= inner.size;
        outer.src_stride = inner.src_stride;
        outer.dst_stride = inner.dst_stride;
        continue;
      }
    }
    sorted[m++] = sorted[i];
  }
  // Fold the innermost axes into the run while they continue it on both sides.
  while (m > 0 && sorted[m - 1].src_stride == run_bytes && sorted[m - 1].dst_stride == run_bytes) {
    run_bytes *= sorted[m - 1].size;
    --m;
  }
  if (m > kMaxRunDims) return false;
  RunMap result;
  result.ndim = m;
  for (int i = 0; i < m; ++i) {
    result.sizes[i] = sorted[i].size;
    result.src_strides[i] = sorted[i].src_stride;
    result.dst_strides[i] = sorted[i].dst_stride;
  }
  result.run_bytes = run_bytes;
  result.src_offset = src_offset;
  result.dst_offset = dst_offset;
  *map = result;
  return true;
}

// Row-major byte strides of `dims` (rank <= kMaxRunDims) with elements of `itemsize`.
inline void RowMajorStrides(const int64_t* dims, int rank, int64_t itemsize, int64_t* strides) {
  int64_t stride = itemsize;
  for (int i = rank - 1; i >= 0; --i) {
    strides[i] = stride;
    stride *= dims[i];
  }
}

// Position of axis letter `letter` in `layout` (length `rank`), or -1.
inline int AxisPosition(const char* layout, int rank, char letter) {
  for (int i = 0; i < rank; ++i) {
    if (layout[i] == letter) return i;
  }
  return -1;
}

// The in-place rewrite of permute_blocks (ratio 1) and merge_blocks (ratio > 1).
//
// The cache block has `dst_dims` in `dst_layout` (letters, `rank` of them, same set as
// `src_layout`). Its bytes currently hold `ratio` sub-blocks back to back, each arranged in
// `src_layout` with the token axis `T / ratio` long; afterwards token `j * n + t` of the block
// holds token `t` of sub-block `j`. When ratio == 1, leading axes that both layouts share are
// independent units (for "LKHTD" -> "LKTHD" each (layer, kv) slab is rewritten on its own), so
// the staging unit is as small as possible.
struct RearrangePlan {
  int64_t units_per_block = 1;
  int64_t unit_bytes = 0;
  RunMap map;  // staged unit (source arrangement) -> unit (dst_layout)
};

inline bool RearrangeMap(const char* src_layout, const char* dst_layout, int rank,
                         const int64_t* dst_dims, int64_t ratio, int64_t itemsize,
                         RearrangePlan* plan) {
  if (rank < 1 || rank > kMaxRunDims || ratio < 1) return false;
  const int t_dst = AxisPosition(dst_layout, rank, 'T');
  if (t_dst < 0 || dst_dims[t_dst] % ratio != 0) return false;
  // Shared leading axes (only without a ratio: a ratio puts the sub-block axis outermost).
  int shared = 0;
  if (ratio == 1) {
    while (shared < rank && src_layout[shared] == dst_layout[shared]) ++shared;
  }
  int64_t units = 1;
  for (int i = 0; i < shared; ++i) units *= dst_dims[i];
  // Destination strides of the unit (the trailing rank - shared axes of dst_layout).
  int64_t dst_strides[kMaxRunDims];
  RowMajorStrides(dst_dims + shared, rank - shared, itemsize, dst_strides);
  int64_t unit_bytes = itemsize;
  for (int i = shared; i < rank; ++i) unit_bytes *= dst_dims[i];
  // Source arrangement of the unit: [ratio, src_layout[shared:] with T / ratio].
  int64_t src_dims[kMaxRunDims];
  for (int i = shared; i < rank; ++i) {
    const int d = AxisPosition(dst_layout, rank, src_layout[i]);
    if (d < 0) return false;
    src_dims[i - shared] = src_layout[i] == 'T' ? dst_dims[d] / ratio : dst_dims[d];
  }
  int64_t src_strides[kMaxRunDims];
  RowMajorStrides(src_dims, rank - shared, itemsize, src_strides);
  const int64_t sub_block_bytes = unit_bytes / ratio;

  MapAxis axes[kMaxRunDims + 1];
  int count = 0;
  for (int i = shared; i < rank; ++i) {
    const int d = AxisPosition(dst_layout, rank, src_layout[i]) - shared;
    axes[count++] = MapAxis{src_dims[i - shared], src_strides[i - shared], dst_strides[d]};
  }
  if (ratio > 1) {
    // Sub-block j starts at j * sub_block_bytes in the source and at token j * n in the
    // destination.
    const int64_t n = dst_dims[t_dst] / ratio;
    axes[count++] = MapAxis{ratio, sub_block_bytes, n * dst_strides[t_dst - shared]};
  }
  RearrangePlan result;
  result.units_per_block = units;
  result.unit_bytes = unit_bytes;
  if (!BuildRunMap(axes, count, itemsize, 0, 0, &result.map)) return false;
  *plan = result;
  return true;
}

// The map of a box of a block (`box_starts` .. + `box_sizes` along every axis of `block_dims`)
// to or from a dense block of shape `box_sizes` (`to_box`: block -> dense buffer; otherwise
// dense buffer -> block).
inline bool BoxMap(const int64_t* block_dims, const int64_t* box_starts, const int64_t* box_sizes,
                   int rank, int64_t itemsize, bool to_box, RunMap* map) {
  if (rank < 0 || rank > kMaxRunDims) return false;
  int64_t block_strides[kMaxRunDims];
  int64_t box_strides[kMaxRunDims];
  RowMajorStrides(block_dims, rank, itemsize, block_strides);
  RowMajorStrides(box_sizes, rank, itemsize, box_strides);
  MapAxis axes[kMaxRunDims];
  int64_t block_offset = 0;
  for (int i = 0; i < rank; ++i) {
    block_offset += box_starts[i] * block_strides[i];
    axes[i] = to_box ? MapAxis{box_sizes[i], block_strides[i], box_strides[i]}
                     : MapAxis{box_sizes[i], box_strides[i], block_strides[i]};
  }
  return BuildRunMap(axes, rank, itemsize, to_box ? block_offset : 0, to_box ? 0 : block_offset,
                     map);
}

// The map of a partial copy over the token axis at `t_axis` of `block_dims`: for every index
// of the axes before it, one run of (rows x the contiguous bytes after it). `map.run_bytes` is
// the whole-axis run; the engines shorten it at run time (BlockCopyRequest::num_rows).
inline bool PrefixMap(const int64_t* block_dims, int rank, int t_axis, int64_t itemsize,
                      RunMap* map, int64_t* row_bytes) {
  if (rank < 1 || rank > kMaxRunDims || t_axis < 0 || t_axis >= rank) return false;
  int64_t strides[kMaxRunDims];
  RowMajorStrides(block_dims, rank, itemsize, strides);
  RunMap result;
  result.ndim = 0;
  for (int i = 0; i < t_axis; ++i) {
    if (block_dims[i] == 1) continue;
    result.sizes[result.ndim] = block_dims[i];
    result.src_strides[result.ndim] = strides[i];
    result.dst_strides[result.ndim] = strides[i];
    ++result.ndim;
  }
  result.run_bytes = block_dims[t_axis] * strides[t_axis];
  *row_bytes = strides[t_axis];
  *map = result;
  return true;
}

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_INDEX_H_
