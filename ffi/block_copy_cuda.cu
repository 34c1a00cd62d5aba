#include "block_copy_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "block_index.h"

namespace jaxkv {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxGridY = 65535;
// Vector moves each thread should make before another CTA is worth launching.
constexpr int64_t kVectorsPerThread = 4;

// One CTA row (blockIdx.x) per pair; blockIdx.y splits the pair's runs across CTAs.
template <typename Vec>
__global__ void BlockCopyKernel(BlockCopyRequest request) {
  const int64_t pair = blockIdx.x;
  const int64_t dst_block = ResolveBlock(request.dst_side, pair);
  if (dst_block < 0) return;
  char* dst = request.dst + BlockOffset(request.dst_side, dst_block);
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;

  const int64_t src_block = ResolveBlock(request.src_side, pair);
  if (src_block < 0) {
    if (!request.zero_fill_skipped) return;
    Vec* out = reinterpret_cast<Vec*>(dst);
    const int64_t count = request.dst_side.block_stride / static_cast<int64_t>(sizeof(Vec));
    for (int64_t k = first; k < count; k += stride) out[k] = Vec{};
    return;
  }
  const char* src = request.src + BlockOffset(request.src_side, src_block);
  const int64_t vectors_per_run = request.map.run_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t total = request.map.num_runs() * vectors_per_run;
  for (int64_t k = first; k < total; k += stride) {
    const int64_t run = k / vectors_per_run;
    const int64_t vector = k - run * vectors_per_run;
    int64_t src_offset = 0;
    int64_t dst_offset = 0;
    request.map.RunOffsets(run, &src_offset, &dst_offset);
    reinterpret_cast<Vec*>(dst + dst_offset)[vector] =
        reinterpret_cast<const Vec*>(src + src_offset)[vector];
  }
}

// Largest power-of-two move (<= 16 bytes) that divides every address and length involved.
int VectorBytes(const BlockCopyRequest& request) {
  uint64_t bits = reinterpret_cast<uintptr_t>(request.src) |
                  reinterpret_cast<uintptr_t>(request.dst) |
                  static_cast<uint64_t>(request.src_side.block_stride) |
                  static_cast<uint64_t>(request.dst_side.block_stride) |
                  static_cast<uint64_t>(request.map.run_bytes);
  for (int i = 0; i < request.map.ndim; ++i) {
    bits |= static_cast<uint64_t>(request.map.src_strides[i]) |
            static_cast<uint64_t>(request.map.dst_strides[i]);
  }
  int width = 16;
  while (width > 1 && (bits & static_cast<uint64_t>(width - 1)) != 0) width /= 2;
  return width;
}

template <typename Vec>
cudaError_t Launch(const BlockCopyRequest& request, cudaStream_t stream) {
  const int64_t vectors =
      std::max(request.map.num_runs() * request.map.run_bytes,
               request.zero_fill_skipped ? request.dst_side.block_stride : int64_t{0}) /
      static_cast<int64_t>(sizeof(Vec));
  const int64_t per_cta = static_cast<int64_t>(kThreadsPerBlock) * kVectorsPerThread;
  const int64_t grid_y = std::clamp<int64_t>((vectors + per_cta - 1) / per_cta, 1, kMaxGridY);
  const dim3 grid(static_cast<unsigned>(request.num_pairs), static_cast<unsigned>(grid_y));
  BlockCopyKernel<Vec><<<grid, kThreadsPerBlock, 0, stream>>>(request);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchBlockCopy(const BlockCopyRequest& request, cudaStream_t stream) {
  if (request.num_pairs <= 0) return cudaSuccess;
  if (request.num_pairs > INT32_MAX) return cudaErrorInvalidValue;
  switch (VectorBytes(request)) {
    case 16:
      return Launch<uint4>(request, stream);
    case 8:
      return Launch<uint2>(request, stream);
    case 4:
      return Launch<uint32_t>(request, stream);
    case 2:
      return Launch<uint16_t>(request, stream);
    default:
      return Launch<uint8_t>(request, stream);
  }
}

}  // namespace jaxkv
