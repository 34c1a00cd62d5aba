#include "block_copy_cuda.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>

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
// A rewrite unit is staged in shared memory whenever it fits the device's opt-in limit
// (227 KiB on sm_90, 163 KiB on sm_80, 99 KiB on sm_86/89): one pass over the data. Larger
// units take the two-launch path through global scratch (twice the traffic). Units up to
// kTwoCtaUnitBytes run kRewriteThreads per CTA, so that two CTAs fit an SM of sm_80/sm_90 and
// one CTA's loads overlap the other's stores. Larger units (e.g. a TensorRT-LLM permute unit
// H8 x T64 x D128 bf16 = 128 KiB) leave room for one CTA per SM; it gets kLargeUnitThreads
// with kStageBatch loads in flight per thread (16 KiB per batch at 16-byte vectors x 1024,
// about what an SM needs in flight to keep HBM busy), so the load phase still saturates
// memory; the single pass moves half the bytes of the staged path. Unmeasured on a GPU: the
// crossover between the two paths is the first thing to tune.
constexpr int64_t kTwoCtaUnitBytes = 80 << 10;
constexpr int kRewriteThreads = 512;
constexpr int kLargeUnitThreads = 1024;
constexpr int kStageBatch = 4;
// Id checks: a grid-stride loop over the ids; a few CTAs suffice for lists of thousands.
constexpr int kIdCheckThreads = 256;
constexpr int64_t kMaxIdCheckCtas = 256;

// Id-check failures on this device since the last TakeIdErrors (kId* bits). A module's
// __device__ variable exists once per device (context), so streams on one device share it.
__device__ uint32_t g_id_errors = 0;
// TakeIdErrors' read-and-clear result (one host caller at a time, see TakeIdErrors).
__device__ uint32_t g_id_errors_taken = 0;

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
// A non-null `verdict` is the device id check of this op: non-zero means the ids are invalid
// and no cache block is written (like the CPU engine, which refuses the call before any
// write); a zero-filling request (gather, split: a fresh dense output) comes out all zeros.
template <typename Vec, typename Index>
__global__ void BlockCopyKernel(BlockCopyRequest request, const uint32_t* verdict) {
  const bool refused = verdict != nullptr && *verdict != 0;
  if (refused && !request.zero_fill_skipped) return;
  const int64_t pair = blockIdx.x;
  const int64_t dst_block = ResolveBlock(request.dst_side, pair);
  if (dst_block < 0) return;
  char* dst = request.dst + BlockOffset(request.dst_side, dst_block);
  const int64_t stride = static_cast<int64_t>(gridDim.y) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;

  const int64_t src_block = refused ? -1 : ResolveBlock(request.src_side, pair);
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

// One CTA of `Threads` threads per (listed block, unit): the unit is staged in shared
// memory, then written back through the map. Only used when a unit fits in shared memory.
// Each thread issues kStageBatch loads before storing them, so that one CTA per SM (large
// units) still keeps enough loads in flight.
template <typename Vec, typename Index, int Threads>
__global__ void __launch_bounds__(Threads)
    BlockRewriteSharedKernel(BlockRewriteRequest request, const uint32_t* verdict) {
  extern __shared__ __align__(16) unsigned char stage[];
  if (verdict != nullptr && *verdict != 0) return;
  const int64_t item = blockIdx.x;
  const int64_t block = ResolveBlock(request.side, item / request.units_per_block);
  if (block < 0) return;
  char* unit = request.data + BlockOffset(request.side, block) +
               (item % request.units_per_block) * request.unit_bytes;
  const Index count = static_cast<Index>(request.unit_bytes / static_cast<int64_t>(sizeof(Vec)));
  const Vec* in = reinterpret_cast<const Vec*>(unit);
  Vec* staged = reinterpret_cast<Vec*>(stage);
  for (Index base = threadIdx.x; base < count; base += kStageBatch * Threads) {
    Vec batch[kStageBatch];
#pragma unroll
    for (int j = 0; j < kStageBatch; ++j) {
      const Index k = base + j * Threads;
      if (k < count) batch[j] = in[k];
    }
#pragma unroll
    for (int j = 0; j < kStageBatch; ++j) {
      const Index k = base + j * Threads;
      if (k < count) staged[k] = batch[j];
    }
  }
  __syncthreads();
  const Index vectors_per_run =
      static_cast<Index>(request.map.run_bytes / static_cast<int64_t>(sizeof(Vec)));
  const Index total = static_cast<Index>(request.map.num_runs()) * vectors_per_run;
  CopyVectors<Vec, Index>(request.map, reinterpret_cast<const char*>(stage), unit,
                          vectors_per_run, total, static_cast<Index>(threadIdx.x),
                          static_cast<Index>(Threads));
}

// ORs `found` into the op's verdict and the device's record.
__device__ void ReportIds(uint32_t found, uint32_t* verdict) {
  if (found == 0) return;
  atomicOr(verdict, found);
  atomicOr(&g_id_errors, found);
}

// Range checks of both lists; with a bitmap, marks every listed block of `ids` and finds the
// ones marked twice.
__global__ void MarkIdsKernel(IdCheckRequest request, uint32_t* verdict, uint32_t* bitmap) {
  uint32_t found = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < request.count; i += stride) {
    const int32_t id = request.ids[i];
    if (id >= request.num_blocks) {
      found |= kIdOutOfRange;
    } else if (id >= 0 && bitmap != nullptr) {
      const uint32_t bit = 1u << (id & 31);
      if ((atomicOr(&bitmap[id >> 5], bit) & bit) != 0) found |= kIdRepeated;
    }
    if (request.other_ids != nullptr && request.other_ids[i] >= request.other_blocks) {
      found |= kIdOutOfRange;
    }
  }
  ReportIds(found, verdict);
}

// After MarkIdsKernel (a separate launch, so that every block of `ids` is marked): the blocks
// of `other_ids` that `ids` lists too.
__global__ void FindSharedIdsKernel(IdCheckRequest request, uint32_t* verdict,
                                    const uint32_t* bitmap) {
  uint32_t found = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < request.count; i += stride) {
    const int32_t id = request.other_ids[i];
    if (id >= 0 && id < request.num_blocks && ((bitmap[id >> 5] >> (id & 31)) & 1u) != 0) {
      found |= kIdShared;
    }
  }
  ReportIds(found, verdict);
}

__global__ void TakeIdErrorsKernel() { g_id_errors_taken = atomicExch(&g_id_errors, 0u); }

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

// Before a launch: an error already pending in this runtime is not this launch's. jaxkv
// consumes the errors of its own failed calls (Checked), so what is left is sticky: an earlier
// kernel faulted asynchronously (any kernel of the context, not necessarily jaxkv's).
// Reporting it under its own name keeps the launch check below from blaming the launch.
CudaStatus BeforeLaunch() {
  const cudaError_t pending = cudaPeekAtLastError();
  if (pending == cudaSuccess) return {};
  return {pending, "an earlier CUDA operation (error pending before the jaxkv launch)"};
}

// Errors of a kernel's execution. Launches are asynchronous, so when one of these is reported
// at a launch it is an earlier kernel's fault (sticky: the context is unusable), which the
// runtime only noticed now.
bool IsExecutionFault(cudaError_t error) {
  switch (error) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorLaunchTimeout:
    case cudaErrorHardwareStackError:
    case cudaErrorIllegalInstruction:
    case cudaErrorMisalignedAddress:
    case cudaErrorInvalidAddressSpace:
    case cudaErrorInvalidPc:
    case cudaErrorAssert:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

// After a launch: its configuration error, if any (BeforeLaunch found nothing pending), or an
// earlier kernel's fault that surfaced at it, named as such.
CudaStatus AfterLaunch(const char* kernel) {
  CudaStatus status = Checked(cudaGetLastError(), kernel);
  if (IsExecutionFault(status.error)) {
    status.call = "an earlier kernel (asynchronous fault reported at a jaxkv launch)";
  }
  return status;
}

template <typename Vec>
CudaStatus LaunchCopy(const BlockCopyRequest& request, const uint32_t* verdict,
                      cudaStream_t stream) {
  const int64_t vectors =
      std::max(request.map.num_runs() * request.map.run_bytes,
               request.zero_fill_skipped ? request.dst_side.block_stride : int64_t{0}) /
      static_cast<int64_t>(sizeof(Vec));
  const int64_t per_cta = static_cast<int64_t>(kThreadsPerBlock) * kVectorsPerThread;
  const int64_t grid_y = std::clamp<int64_t>((vectors + per_cta - 1) / per_cta, 1, kMaxGridY);
  const dim3 grid(static_cast<unsigned>(request.num_pairs), static_cast<unsigned>(grid_y));
  CudaStatus status = BeforeLaunch();
  if (!status.ok()) return status;
  if (FitsInt32(vectors + grid_y * kThreadsPerBlock)) {
    BlockCopyKernel<Vec, uint32_t><<<grid, kThreadsPerBlock, 0, stream>>>(request, verdict);
  } else {
    BlockCopyKernel<Vec, int64_t><<<grid, kThreadsPerBlock, 0, stream>>>(request, verdict);
  }
  return AfterLaunch("block copy kernel launch");
}

// Every instantiation of the shared-memory rewrite kernel, for the one-time opt-in.
template <typename Fn>
void ForEachRewriteKernel(Fn fn) {
  auto both_sizes = [&](auto vec) {
    using Vec = decltype(vec);
    fn(BlockRewriteSharedKernel<Vec, uint32_t, kRewriteThreads>);
    fn(BlockRewriteSharedKernel<Vec, int64_t, kRewriteThreads>);
    fn(BlockRewriteSharedKernel<Vec, uint32_t, kLargeUnitThreads>);
    fn(BlockRewriteSharedKernel<Vec, int64_t, kLargeUnitThreads>);
  };
  both_sizes(uint4{});
  both_sizes(uint2{});
  both_sizes(uint32_t{});
  both_sizes(uint16_t{});
  both_sizes(uint8_t{});
}

// The largest unit the shared-memory kernels can stage on the current device. The first call
// per device raises every rewrite kernel's dynamic shared memory limit to the device's opt-in
// maximum, once: setting it per call to the unit's size would race between host threads (one
// thread lowering the limit between another's set and launch). A device or attribute query
// that fails leaves the opt-in off (48 KiB, no attribute needed): larger units then take the
// staged path, which is correct for every unit, only slower; the error is consumed.
CudaStatus MaxSharedUnitBytes(int64_t* bytes) {
  static std::mutex mutex;
  static std::map<int, int64_t>* limits = new std::map<int, int64_t>();  // never destroyed
  int device = 0;
  CudaStatus status = Checked(cudaGetDevice(&device), "cudaGetDevice");
  if (!status.ok()) return status;
  std::lock_guard<std::mutex> lock(mutex);
  auto known = limits->find(device);
  if (known == limits->end()) {
    int optin = 0;
    int64_t limit = kDefaultSharedBytes;
    if (Checked(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
                "cudaDeviceGetAttribute")
            .ok() &&
        optin > kDefaultSharedBytes) {
      bool all_set = true;
      ForEachRewriteKernel([&](auto kernel) {
        all_set = all_set && Checked(cudaFuncSetAttribute(
                                         kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         optin),
                                     "cudaFuncSetAttribute")
                                 .ok();
      });
      if (all_set) limit = optin;
    }
    known = limits->emplace(device, limit).first;
  }
  *bytes = known->second;
  return {};
}

template <typename Vec, int Threads>
CudaStatus LaunchRewriteShared(const BlockRewriteRequest& request, int64_t items,
                               const uint32_t* verdict, cudaStream_t stream) {
  const size_t shared = static_cast<size_t>(request.unit_bytes);
  const bool small = FitsInt32(request.unit_bytes / static_cast<int64_t>(sizeof(Vec)) +
                               kStageBatch * Threads);
  CudaStatus status = BeforeLaunch();
  if (!status.ok()) return status;
  if (small) {
    BlockRewriteSharedKernel<Vec, uint32_t, Threads>
        <<<static_cast<unsigned>(items), Threads, shared, stream>>>(request, verdict);
  } else {
    BlockRewriteSharedKernel<Vec, int64_t, Threads>
        <<<static_cast<unsigned>(items), Threads, shared, stream>>>(request, verdict);
  }
  return AfterLaunch("block rewrite kernel launch (shared memory)");
}

template <typename Vec>
CudaStatus LaunchRewriteShared(const BlockRewriteRequest& request, int64_t items,
                               const uint32_t* verdict, cudaStream_t stream) {
  if (request.unit_bytes <= kTwoCtaUnitBytes) {
    return LaunchRewriteShared<Vec, kRewriteThreads>(request, items, verdict, stream);
  }
  return LaunchRewriteShared<Vec, kLargeUnitThreads>(request, items, verdict, stream);
}

CudaStatus DispatchCopy(const BlockCopyRequest& request, const uint32_t* verdict,
                        cudaStream_t stream) {
  switch (VectorBytes(request)) {
    case 16:
      return LaunchCopy<uint4>(request, verdict, stream);
    case 8:
      return LaunchCopy<uint2>(request, verdict, stream);
    case 4:
      return LaunchCopy<uint32_t>(request, verdict, stream);
    case 2:
      return LaunchCopy<uint16_t>(request, verdict, stream);
    default:
      return LaunchCopy<uint8_t>(request, verdict, stream);
  }
}

// Whether `request` takes the shared-memory path on the current device.
CudaStatus UsesSharedPath(const BlockRewriteRequest& request, bool* shared) {
  int64_t limit = 0;
  CudaStatus status = MaxSharedUnitBytes(&limit);
  if (!status.ok()) return status;
  *shared = request.unit_bytes <= limit && request.num_ids * request.units_per_block <= kMaxGridX;
  return {};
}

}  // namespace

CudaStatus LaunchIdCheck(const IdCheckRequest& request, uint32_t* verdict, uint32_t* bitmap,
                         cudaStream_t stream) {
  if (request.count <= 0) return {};
  const int64_t words = IdCheckBitmapWords(request);
  if (words > 0) {
    CudaStatus status = Checked(
        cudaMemsetAsync(bitmap, 0, static_cast<size_t>(words) * sizeof(uint32_t), stream),
        "cudaMemsetAsync (id check bitmap)");
    if (!status.ok()) return status;
  }
  const int64_t ctas = std::min<int64_t>(
      (request.count + kIdCheckThreads - 1) / kIdCheckThreads, kMaxIdCheckCtas);
  CudaStatus status = BeforeLaunch();
  if (!status.ok()) return status;
  MarkIdsKernel<<<static_cast<unsigned>(ctas), kIdCheckThreads, 0, stream>>>(
      request, verdict, words > 0 ? bitmap : nullptr);
  status = AfterLaunch("id check kernel launch");
  if (!status.ok() || !request.disjoint) return status;
  FindSharedIdsKernel<<<static_cast<unsigned>(ctas), kIdCheckThreads, 0, stream>>>(
      request, verdict, bitmap);
  return AfterLaunch("id overlap check kernel launch");
}

CudaStatus TakeIdErrors(int device, uint32_t* errors) {
  // g_id_errors_taken is one word per device: one host caller at a time.
  static std::mutex mutex;
  std::lock_guard<std::mutex> lock(mutex);
  CudaStatus status = Checked(cudaSetDevice(device), "cudaSetDevice");
  if (!status.ok()) return status;
  status = Checked(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
  if (!status.ok()) return status;
  // Exchanged on the device: a check finishing on another stream meanwhile is not lost.
  TakeIdErrorsKernel<<<1, 1>>>();
  status = AfterLaunch("id error record read kernel launch");
  if (!status.ok()) return status;
  return Checked(cudaMemcpyFromSymbol(errors, g_id_errors_taken, sizeof(uint32_t)),
                 "cudaMemcpyFromSymbol (id error record)");
}

CudaStatus LaunchBlockCopy(const BlockCopyRequest& request, const uint32_t* verdict,
                           cudaStream_t stream) {
  if (request.num_pairs <= 0) return {};
  if (request.num_pairs > INT32_MAX) return {cudaErrorInvalidValue, "block copy (too many ids)"};
  return DispatchCopy(request, verdict, stream);
}

CudaStatus RewriteStagingBytes(const BlockRewriteRequest& request, int64_t* bytes) {
  bool shared = false;
  CudaStatus status = UsesSharedPath(request, &shared);
  if (!status.ok()) return status;
  *bytes = shared ? 0 : request.units_per_block * request.unit_bytes;
  return {};
}

CudaStatus LaunchBlockRewrite(const BlockRewriteRequest& request, const uint32_t* verdict,
                              cudaStream_t stream) {
  if (request.num_ids <= 0 || request.unit_bytes <= 0) return {};
  bool shared = false;
  CudaStatus status = UsesSharedPath(request, &shared);
  if (!status.ok()) return status;
  if (shared) {
    const int64_t items = request.num_ids * request.units_per_block;
    const uint64_t bits = reinterpret_cast<uintptr_t>(request.data) |
                          static_cast<uint64_t>(request.side.block_stride) |
                          static_cast<uint64_t>(request.unit_bytes) | MapBits(request.map);
    switch (VectorWidth(bits)) {
      case 16:
        return LaunchRewriteShared<uint4>(request, items, verdict, stream);
      case 8:
        return LaunchRewriteShared<uint2>(request, items, verdict, stream);
      case 4:
        return LaunchRewriteShared<uint32_t>(request, items, verdict, stream);
      case 2:
        return LaunchRewriteShared<uint16_t>(request, items, verdict, stream);
      default:
        return LaunchRewriteShared<uint8_t>(request, items, verdict, stream);
    }
  }
  // Units too large for shared memory: per chunk of listed blocks, copy the blocks into the
  // staging buffer (dense), then write them back through the map with the units as an outer
  // axis. Launches on one stream run in order, so chunks can reuse the staging buffer.
  const int64_t block_bytes = request.units_per_block * request.unit_bytes;
  const int64_t chunk = request.staging_bytes / block_bytes;
  if (chunk < 1) return {cudaErrorInvalidValue, "block rewrite (staging smaller than a block)"};
  if (request.map.ndim >= kMaxRunDims) {
    return {cudaErrorInvalidValue, "block rewrite (map has too many axes for staging)"};
  }
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
    status = DispatchCopy(in, verdict, stream);
    if (!status.ok()) return status;
    BlockCopyRequest out;
    out.src = request.staging;
    out.dst = request.data;
    out.src_side = {count, block_bytes, nullptr};
    out.dst_side = {request.side.num_blocks, request.side.block_stride, request.side.ids + first};
    out.num_pairs = count;
    out.map = block_map;
    status = DispatchCopy(out, verdict, stream);
    if (!status.ok()) return status;
  }
  return {};
}

}  // namespace jaxkv
