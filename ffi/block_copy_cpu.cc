#include "block_copy_cpu.h"

#include <sys/mman.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "block_index.h"

namespace jaxkv {
namespace {

// Requests moving at least this many bytes are split across threads: one thread cannot
// saturate memory bandwidth, nor take the page faults of a freshly allocated output alone.
constexpr int64_t kParallelBytes = int64_t{4} << 20;
constexpr unsigned kMaxThreads = 8;

void CopyPairRange(const BlockCopyRequest& request, int64_t first, int64_t last) {
  const RunMap& map = request.map;
  const int64_t num_runs = map.num_runs();
  for (int64_t pair = first; pair < last; ++pair) {
    const int64_t dst_block = ResolveBlock(request.dst_side, pair);
    if (dst_block < 0) continue;
    char* dst = request.dst + BlockOffset(request.dst_side, dst_block);
    const int64_t src_block = ResolveBlock(request.src_side, pair);
    if (src_block < 0) {
      if (request.zero_fill_skipped) {
        std::memset(dst, 0, static_cast<size_t>(request.dst_side.block_stride));
      }
      continue;
    }
    const char* src = request.src + BlockOffset(request.src_side, src_block);
    if (map.ndim == 0) {
      std::memcpy(dst, src, static_cast<size_t>(map.run_bytes));
      continue;
    }
    for (int64_t run = 0; run < num_runs; ++run) {
      int64_t src_offset = 0;
      int64_t dst_offset = 0;
      map.RunOffsets(run, &src_offset, &dst_offset);
      std::memcpy(dst + dst_offset, src + src_offset, static_cast<size_t>(map.run_bytes));
    }
  }
}

constexpr int64_t kHugePageBytes = int64_t{2} << 20;

}  // namespace

void AdviseFreshOutput(void* data, int64_t bytes) {
#if defined(MADV_HUGEPAGE)
  if (bytes < 2 * kHugePageBytes) return;
  const uintptr_t begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + kHugePageBytes - 1) & ~static_cast<uintptr_t>(kHugePageBytes - 1);
  const uintptr_t last = (begin + bytes) & ~static_cast<uintptr_t>(kHugePageBytes - 1);
  if (last > first) {
    madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advisory only
  }
#else
  (void)data;
  (void)bytes;
#endif
}

void CopyBlocksCpu(const BlockCopyRequest& request) {
  const int64_t bytes_per_pair =
      std::max(request.map.num_runs() * request.map.run_bytes, request.dst_side.block_stride);
  const int64_t total_bytes = bytes_per_pair * request.num_pairs;
  unsigned threads = 1;
  if (total_bytes >= kParallelBytes) {
    threads = std::min({std::max(1u, std::thread::hardware_concurrency()), kMaxThreads,
                        static_cast<unsigned>(std::min<int64_t>(request.num_pairs, kMaxThreads))});
  }
  if (threads <= 1) {
    CopyPairRange(request, 0, request.num_pairs);
    return;
  }
  // Destinations are unique and disjoint from sources (checked by the handlers), so pairs can
  // run in any order.
  std::vector<std::thread> workers;
  workers.reserve(threads - 1);
  const int64_t chunk = (request.num_pairs + threads - 1) / threads;
  for (unsigned t = 1; t < threads; ++t) {
    const int64_t first = std::min<int64_t>(request.num_pairs, t * chunk);
    const int64_t last = std::min<int64_t>(request.num_pairs, first + chunk);
    workers.emplace_back(CopyPairRange, std::cref(request), first, last);
  }
  CopyPairRange(request, 0, std::min<int64_t>(request.num_pairs, chunk));
  for (auto& worker : workers) worker.join();
}

}  // namespace jaxkv
