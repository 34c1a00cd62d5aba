#include "block_copy_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "block_index.h"

namespace jaxkv {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kMaxGridY = 65535;
constexpr int64_t kMaxGridX = 2147483647;
// Vector moves each thread should make before another CTA is worth launching.
constexpr int64_t kVectorsPerThread = 4;
// Shared memory a kernel may use without opting in.
constexpr int64_t kDefaultSharedBytes = 48 << 10;
// Units up to this size are staged in shared memory (opting in above 48 KiB): at least two
// CTAs of kRewriteThreads fit an SM of sm_80/sm_90, enough to keep memory busy. Larger units
// take the two-launch path through global scratch (twice the traffic, full occupancy).
// Unmeasured on a GPU: a starting point to tune.
constexpr int64_t kMaxSharedUnitBytes = 80 << 10;
constexpr int kRewriteThreads = 512;

// Moves vectors [first, total) with step `stride` of a map from `src` to `dst`, where run r
// holds `vectors_per_run` vectors. `Index` is 32-bit when the counts allow (cheap divisions).
template <typename Vec, typename Index>
__device__ __forceinline__ void CopyVectors(const RunMap& map, const char* src, char* dst,
                                            Index vectors_per_run, Index total, Index first,
                                            Index stride) {
  for (Index k = first; k < total; k += stride) {
    const Index run = k / vectors_per_run;
    const Index vector = k - run * vectors_per_run;
    int64_t src_offset = 0;
    int64_t dst_offset = 0;
    map.RunOffsets<Index>(run, &src_offset, &dst_offset);
    reinterpret_cast<Vec*>(dst + dst_offset)[vector] =
        reinterpret_cast<const Vec*>(src + src_offset)[vector];
  }
}

// One CTA row (blockIdx.x) per pair; blockIdx.y splits the pair's runs across CTAs.
template <typename Vec, typename Index>
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
  const int64_t run_bytes =
      request.num_rows == nullptr
          ? request.map.run_bytes
          : EffectiveRows(*request.num_rows, request.max_rows) * request.row_bytes;
  const int64_t vectors_per_run = run_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t total = request.map.num_runs() * vectors_per_run;
  CopyVectors<Vec, Index>(request.map, src, dst, static_cast<Index>(vectors_per_run),
                          static_cast<Index>(total), static_cast<Index>(first),
                          static_cast<Index>(stride));
}

// One CTA per (listed block, unit): the unit is staged in shared memory, then written back
// through the map. Only used when a unit fits in shared memory.
template <typename Vec, typename Index>
__global__ void BlockRewriteSharedKernel(BlockRewriteRequest request) {
  extern __shared__ __align__(16) unsigned char stage[];
  const int64_t item = blockIdx.x;
  const int64_t block = ResolveBlock(request.side, item / request.units_per_block);
  if (block < 0) return;
  char* unit = request.data + BlockOffset(request.side, block) +
               (item % request.units_per_block) * request.unit_bytes;
  const Index count = static_cast<Index>(request.unit_bytes / static_cast<int64_t>(sizeof(Vec)));
  const Vec* in = reinterpret_cast<const Vec*>(unit);
  Vec* staged = reinterpret_cast<Vec*>(stage);
  for (Index k = threadIdx.x; k < count; k += blockDim.x) staged[k] = in[k];
  __syncthreads();
  const Index vectors_per_run =
      static_cast<Index>(request.map.run_bytes / static_cast<int64_t>(sizeof(Vec)));
  const Index total = static_cast<Index>(request.map.num_runs()) * vectors_per_run;
  CopyVectors<Vec, Index>(request.map, reinterpret_cast<const char*>(stage), unit,
                          vectors_per_run, total, static_cast<Index>(threadIdx.x),
                          static_cast<Index>(blockDim.x));
}

// Largest power-of-two move (<= 16 bytes) dividing every address, stride and length given.
int VectorWidth(uint64_t bits) {
  int width = 16;
  while (width > 1 && (bits & static_cast<uint64_t>(width - 1)) != 0) width /= 2;
  return width;
}

uint64_t MapBits(const RunMap& map) {
  uint64_t bits = static_cast<uint64_t>(map.run_bytes) | static_cast<uint64_t>(map.src_offset) |
                  static_cast<uint64_t>(map.dst_offset);
  for (int i = 0; i < map.ndim; ++i) {
    bits |= static_cast<uint64_t>(map.src_strides[i]) | static_cast<uint64_t>(map.dst_strides[i]);
  }
  return bits;
}

int VectorBytes(const BlockCopyRequest& request) {
  uint64_t bits = reinterpret_cast<uintptr_t>(request.src) |
                  reinterpret_cast<uintptr_t>(request.dst) |
                  static_cast<uint64_t>(request.src_side.block_stride) |
                  static_cast<uint64_t>(request.dst_side.block_stride) | MapBits(request.map);
  if (request.num_rows != nullptr) bits |= static_cast<uint64_t>(request.row_bytes);
  return VectorWidth(bits);
}

// Whether every vector index of one pair (or unit) fits a 32-bit counter with room for the
// stride added to it.
bool FitsInt32(int64_t vectors) { return vectors < (int64_t{1} << 30); }

template <typename Vec>
cudaError_t LaunchCopy(const BlockCopyRequest& request, cudaStream_t stream) {
  const int64_t vectors =
      std::max(request.map.num_runs() * request.map.run_bytes,
               request.zero_fill_skipped ? request.dst_side.block_stride : int64_t{0}) /
      static_cast<int64_t>(sizeof(Vec));
  const int64_t per_cta = static_cast<int64_t>(kThreadsPerBlock) * kVectorsPerThread;
  const int64_t grid_y = std::clamp<int64_t>((vectors + per_cta - 1) / per_cta, 1, kMaxGridY);
  const dim3 grid(static_cast<unsigned>(request.num_pairs), static_cast<unsigned>(grid_y));
  if (FitsInt32(vectors + grid_y * kThreadsPerBlock)) {
    BlockCopyKernel<Vec, uint32_t><<<grid, kThreadsPerBlock, 0, stream>>>(request);
  } else {
    BlockCopyKernel<Vec, int64_t><<<grid, kThreadsPerBlock, 0, stream>>>(request);
  }
  return cudaGetLastError();
}

template <typename Vec>
cudaError_t LaunchRewriteShared(const BlockRewriteRequest& request, int64_t items,
                                cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(request.unit_bytes);
  const bool small = FitsInt32(request.unit_bytes / static_cast<int64_t>(sizeof(Vec)) +
                               kRewriteThreads);
  auto kernel = small ? BlockRewriteSharedKernel<Vec, uint32_t>
                      : BlockRewriteSharedKernel<Vec, int64_t>;
  if (request.unit_bytes > kDefaultSharedBytes) {
    const cudaError_t status = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(shared));
    if (status != cudaSuccess) return status;
  }
  kernel<<<static_cast<unsigned>(items), kRewriteThreads, shared, stream>>>(request);
  return cudaGetLastError();
}

// The largest unit the shared-memory kernel can stage on the current device.
int64_t MaxSharedUnitBytes() {
  int device = 0;
  int optin = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) !=
          cudaSuccess) {
    cudaGetLastError();  // clear the (non-sticky) error; fall back to the default
    return kDefaultSharedBytes;
  }
  return std::clamp<int64_t>(optin, kDefaultSharedBytes, kMaxSharedUnitBytes);
}

cudaError_t DispatchCopy(const BlockCopyRequest& request, cudaStream_t stream) {
  switch (VectorBytes(request)) {
    case 16:
      return LaunchCopy<uint4>(request, stream);
    case 8:
      return LaunchCopy<uint2>(request, stream);
    case 4:
      return LaunchCopy<uint32_t>(request, stream);
    case 2:
      return LaunchCopy<uint16_t>(request, stream);
    default:
      return LaunchCopy<uint8_t>(request, stream);
  }
}

}  // namespace

cudaError_t LaunchBlockCopy(const BlockCopyRequest& request, cudaStream_t stream) {
  if (request.num_pairs <= 0) return cudaSuccess;
  if (request.num_pairs > INT32_MAX) return cudaErrorInvalidValue;
  return DispatchCopy(request, stream);
}

cudaError_t LaunchBlockRewrite(const BlockRewriteRequest& request, cudaStream_t stream) {
  if (request.num_ids <= 0 || request.unit_bytes <= 0) return cudaSuccess;
  const int64_t items = request.num_ids * request.units_per_block;
  if (request.unit_bytes <= MaxSharedUnitBytes() && items <= kMaxGridX) {
    const uint64_t bits = reinterpret_cast<uintptr_t>(request.data) |
                          static_cast<uint64_t>(request.side.block_stride) |
                          static_cast<uint64_t>(request.unit_bytes) | MapBits(request.map);
    switch (VectorWidth(bits)) {
      case 16:
        return LaunchRewriteShared<uint4>(request, items, stream);
      case 8:
        return LaunchRewriteShared<uint2>(request, items, stream);
      case 4:
        return LaunchRewriteShared<uint32_t>(request, items, stream);
      case 2:
        return LaunchRewriteShared<uint16_t>(request, items, stream);
      default:
        return LaunchRewriteShared<uint8_t>(request, items, stream);
    }
  }
  // Units too large for shared memory: per chunk of listed blocks, copy the blocks into the
  // staging buffer (dense), then write them back through the map with the units as an outer
  // axis. Launches on one stream run in order, so chunks can reuse the staging buffer.
  const int64_t block_bytes = request.units_per_block * request.unit_bytes;
  const int64_t chunk = request.staging_bytes / block_bytes;
  if (chunk < 1 || request.map.ndim >= kMaxRunDims) return cudaErrorInvalidValue;
  RunMap block_map = request.map;
  if (request.units_per_block > 1) {
    for (int i = block_map.ndim; i > 0; --i) {
      block_map.sizes[i] = block_map.sizes[i - 1];
      block_map.src_strides[i] = block_map.src_strides[i - 1];
      block_map.dst_strides[i] = block_map.dst_strides[i - 1];
    }
    block_map.sizes[0] = request.units_per_block;
    block_map.src_strides[0] = request.unit_bytes;
    block_map.dst_strides[0] = request.unit_bytes;
    ++block_map.ndim;
  }
  for (int64_t first = 0; first < request.num_ids; first += chunk) {
    const int64_t count = std::min(chunk, request.num_ids - first);
    BlockCopyRequest in;
    in.src = request.data;
    in.dst = request.staging;
    in.src_side = {request.side.num_blocks, request.side.block_stride, request.side.ids + first};
    in.dst_side = {count, block_bytes, nullptr};
    in.num_pairs = count;
    in.map = IdentityRunMap(block_bytes);
    cudaError_t status = DispatchCopy(in, stream);
    if (status != cudaSuccess) return status;
    BlockCopyRequest out;
    out.src = request.staging;
    out.dst = request.data;
    out.src_side = {count, block_bytes, nullptr};
    out.dst_side = {request.side.num_blocks, request.side.block_stride, request.side.ids + first};
    out.num_pairs = count;
    out.map = block_map;
    status = DispatchCopy(out, stream);
    if (status != cudaSuccess) return status;
  }
  return cudaSuccess;
}

}  // namespace jaxkv
