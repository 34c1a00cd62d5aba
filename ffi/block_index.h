// Index math shared by the CPU and CUDA block-copy engines.
//
// Every jaxkv block operation is a list of (source block, destination block) pairs plus one
// `RunMap` that says how the bytes of a source block land in its destination block. A RunMap
// is a strided iteration over up to kMaxRunDims outer axes; each iteration moves one
// contiguous run of `run_bytes`. A plain block copy is the identity map: no outer axes and a
// single run of the whole block. Reshaping ops (permute, merge, partial copy) are other maps.
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

  JAXKV_HOST_DEVICE int64_t num_runs() const {
    int64_t n = 1;
    for (int32_t i = 0; i < ndim; ++i) n *= sizes[i];
    return n;
  }

  // Byte offsets, inside the source and destination blocks, of run number `run`
  // (row-major over the outer axes, last axis fastest).
  JAXKV_HOST_DEVICE void RunOffsets(int64_t run, int64_t* src_offset,
                                    int64_t* dst_offset) const {
    int64_t src = 0;
    int64_t dst = 0;
    for (int32_t i = ndim - 1; i >= 0; --i) {
      const int64_t index = run % sizes[i];
      run /= sizes[i];
      src += index * src_strides[i];
      dst += index * dst_strides[i];
    }
    *src_offset = src;
    *dst_offset = dst;
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
};

}  // namespace jaxkv

#endif  // JAXKV_FFI_BLOCK_INDEX_H_
