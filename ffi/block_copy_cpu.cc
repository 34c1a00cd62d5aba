#include "block_copy_cpu.h"

#include <sys/mman.h>

// Streaming (non-temporal) stores and software prefetch; off with JAXKV_NO_STREAMING_STORES
// (sanitizer builds: AddressSanitizer does not check _mm_stream_si128 stores, so there every
// byte goes through memcpy, which it does check).
#if defined(__SSE2__) && !defined(JAXKV_NO_STREAMING_STORES)
#define JAXKV_STREAMING_STORES 1
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "block_index.h"
#include "thread_pool.h"

namespace jaxkv {
namespace {

// Requests moving at least this many bytes are split across threads: one thread cannot
// saturate memory bandwidth, nor take the page faults of a freshly allocated output alone.
constexpr int64_t kParallelBytes = int64_t{4} << 20;
constexpr unsigned kMaxThreads = 8;
constexpr int64_t kMaxRequests = 64;
// Requests writing at least this many bytes (half of a large L3) use non-temporal stores for
// their runs: the destination is not read soon, and streaming stores skip reading each
// destination line before writing it (a third of the traffic of a cached copy; this is what
// glibc's memcpy does for large copies, i.e. what a numpy copy of the same bytes gets).
constexpr int64_t kStreamBytes = int64_t{16} << 20;
// Software prefetch of strided runs (see StreamCopy): runs up to this long, fetched
// about this far ahead.
constexpr int64_t kPrefetchMaxRun = int64_t{16} << 10;
constexpr int64_t kPrefetchDistance = int64_t{16} << 10;
// Byte-row copies (CopyByteRowsCpu) of at least this many bytes in all use streaming stores:
// a formatted read's chunk (MiBs) is read by the wire or the model later, not by this thread.
constexpr int64_t kRowStreamBytes = int64_t{1} << 20;
// ... and prefetch the chunk about this far ahead (at least the next one).
constexpr int64_t kRowPrefetchDistance = int64_t{4} << 10;

// Copies `bytes` (a multiple of 16) to a 16-byte aligned `dst` with streaming stores. With
// `next`, also prefetches the `bytes` at `next` (the run to copy a few runs later), one cache
// line per line copied: short runs separated by gaps (a token prefix of every head row) defeat
// the hardware prefetchers, which stop at each gap and then fetch the gap too. Measured here:
// 2 KiB runs every 4 KiB went from 0.5x to 0.7x (one thread) and from 1.0x to 1.4x (two
// threads) of a plain copy of the same bytes. Prefetches never fault, so `next` may point past
// the source buffer.
inline void StreamCopy(char* dst, const char* src, size_t bytes, const char* next = nullptr) {
#if defined(JAXKV_STREAMING_STORES)
  size_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    if (next != nullptr) _mm_prefetch(next + i, _MM_HINT_T0);
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  for (; i < bytes; i += 16) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
  }
#else
  (void)next;
  std::memcpy(dst, src, bytes);
#endif
}

// memcpy of `bytes` that also prefetches the `bytes` at `next` (the chunk to copy a few
// chunks later), one cache line per 64 bytes copied; for destinations StreamCopy cannot take
// (unaligned) or should not (small copies, which stay in cache).
inline void PrefetchCopy(char* dst, const char* src, size_t bytes, const char* next) {
#if defined(JAXKV_STREAMING_STORES)
  if (next != nullptr) {
    size_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
      _mm_prefetch(next + i, _MM_HINT_T0);
      std::memcpy(dst + i, src + i, 64);
    }
    std::memcpy(dst + i, src + i, bytes - i);
    return;
  }
#else
  (void)next;
#endif
  std::memcpy(dst, src, bytes);
}

// Orders this thread's streaming stores before whatever it does next (reporting its chunk
// done to the thread pool included).
inline void StreamFence() {
#if defined(JAXKV_STREAMING_STORES)
  _mm_sfence();
#endif
}

// Whether runs of `run_bytes` at every offset of `map` from `dst` can be streamed: 16-byte
// aligned destinations and lengths, and long enough to be worth it.
bool Streamable(const RunMap& map, const char* dst, int64_t run_bytes) {
  uint64_t bits = reinterpret_cast<uintptr_t>(dst) | static_cast<uint64_t>(run_bytes) |
                  static_cast<uint64_t>(map.dst_offset);
  for (int32_t i = 0; i < map.ndim; ++i) bits |= static_cast<uint64_t>(map.dst_strides[i]);
  return run_bytes >= 256 && (bits & 15) == 0;
}

// Copies run by run from `src` to `dst` following `map`, with `run_bytes` per run. The outer
// axes are walked with an odometer (no division per run) and the innermost one in a tight
// loop: reshaping maps move many short runs (one head row of D elements, often 256 bytes).
void CopyRuns(const RunMap& map, const char* src, char* dst, int64_t run_bytes,
              bool stream = false) {
  src += map.src_offset;
  dst += map.dst_offset;
  const size_t bytes = static_cast<size_t>(run_bytes);
  if (map.ndim == 0) {
    if (stream) {
      StreamCopy(dst, src, bytes);
    } else {
      std::memcpy(dst, src, bytes);
    }
    return;
  }
  const int32_t last = map.ndim - 1;
  const int64_t inner_size = map.sizes[last];
  const int64_t inner_src = map.src_strides[last];
  const int64_t inner_dst = map.dst_strides[last];
  // Streamed runs shorter than their source stride leave gaps: prefetch the run
  // `prefetch_ahead` strides on (about 16 KiB ahead). Past the innermost axis that address is
  // the right one when the outer axes continue with the same stride (a prefix of every head
  // row of a contiguous block) and a harmless wasted hint otherwise.
  int64_t prefetch_ahead = 0;
  if (stream && inner_src > run_bytes && run_bytes <= kPrefetchMaxRun) {
    prefetch_ahead = std::clamp<int64_t>(kPrefetchDistance / inner_src, 1, 16);
  }
  int64_t index[kMaxRunDims] = {};
  int64_t src_base = 0;
  int64_t dst_base = 0;
  while (true) {
    const char* s = src + src_base;
    char* d = dst + dst_base;
    // Common short runs get a fixed-size memcpy the compiler turns into a few moves.
    switch (stream ? 0 : bytes) {
      case 0:
        for (int64_t i = 0; i < inner_size; ++i) {
          StreamCopy(d + i * inner_dst, s + i * inner_src, bytes,
                     prefetch_ahead > 0 ? s + (i + prefetch_ahead) * inner_src : nullptr);
        }
        break;
      case 16:
        for (int64_t i = 0; i < inner_size; ++i) std::memcpy(d + i * inner_dst, s + i * inner_src, 16);
        break;
      case 32:
        for (int64_t i = 0; i < inner_size; ++i) std::memcpy(d + i * inner_dst, s + i * inner_src, 32);
        break;
      case 64:
        for (int64_t i = 0; i < inner_size; ++i) std::memcpy(d + i * inner_dst, s + i * inner_src, 64);
        break;
      case 128:
        for (int64_t i = 0; i < inner_size; ++i) std::memcpy(d + i * inner_dst, s + i * inner_src, 128);
        break;
      case 256:
        for (int64_t i = 0; i < inner_size; ++i) std::memcpy(d + i * inner_dst, s + i * inner_src, 256);
        break;
      default:
        for (int64_t i = 0; i < inner_size; ++i) {
          std::memcpy(d + i * inner_dst, s + i * inner_src, bytes);
        }
    }
    // Advance the odometer over the outer axes (all but the innermost).
    int32_t axis = last - 1;
    for (; axis >= 0; --axis) {
      src_base += map.src_strides[axis];
      dst_base += map.dst_strides[axis];
      if (++index[axis] < map.sizes[axis]) break;
      src_base -= map.sizes[axis] * map.src_strides[axis];
      dst_base -= map.sizes[axis] * map.dst_strides[axis];
      index[axis] = 0;
    }
    if (axis < 0) return;
  }
}

// Copies pairs [first, last) of every request (pair-major: for one pair, each request in turn,
// so that a source block read by several requests, as in a split, is read from memory once).
void CopyPairRange(const BlockCopyRequest* requests, int64_t count, int64_t first, int64_t last,
                   bool stream_requested) {
  int64_t run_bytes[kMaxRequests];
  bool stream[kMaxRequests];
  bool any_stream = false;
  for (int64_t r = 0; r < count; ++r) {
    const BlockCopyRequest& request = requests[r];
    run_bytes[r] = request.num_rows == nullptr
                       ? request.map.run_bytes
                       : EffectiveRows(*request.num_rows, request.max_rows) * request.row_bytes;
    stream[r] = stream_requested && Streamable(request.map, request.dst, run_bytes[r]) &&
                request.dst_side.block_stride % 16 == 0;
    any_stream = any_stream || stream[r];
  }
  for (int64_t pair = first; pair < last; ++pair) {
    for (int64_t r = 0; r < count; ++r) {
      const BlockCopyRequest& request = requests[r];
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
      CopyRuns(request.map, src, dst, run_bytes[r], stream[r]);
    }
  }
  if (any_stream) StreamFence();
}

unsigned ThreadsFor(int64_t total_bytes, int64_t items) {
  if (total_bytes < kParallelBytes) return 1;
  return std::min({ParallelThreads(), kMaxThreads,
                   static_cast<unsigned>(std::min<int64_t>(items, kMaxThreads))});
}

constexpr int64_t kHugePageBytes = int64_t{2} << 20;

#if defined(JAXKV_STREAMING_STORES)
constexpr bool kStreamingStores = true;
#else
constexpr bool kStreamingStores = false;
#endif

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

void CopyByteRowsCpu(const ByteRow* rows, int64_t num_rows) {
  int64_t total_bytes = 0;
  for (int64_t i = 0; i < num_rows; ++i) total_bytes += rows[i].length * rows[i].count;
  const bool stream = kStreamingStores && total_bytes >= kRowStreamBytes;
  // The chunks (row i, repeat c) in order, with a second cursor `ahead` chunks on whose source
  // is prefetched while the current chunk is copied: a gather of scattered 4 KiB chunks
  // otherwise waits for memory at the start of every chunk, where the hardware prefetchers
  // stop (measured here: 13 -> 20+ GB/s for a 64 MiB gather of random 4 KiB chunks).
  int64_t next_row = 0;
  int64_t next_chunk = 0;
  auto advance = [rows, num_rows](int64_t& row, int64_t& chunk) {
    if (++chunk >= rows[row].count) {
      chunk = 0;
      do {
        ++row;
      } while (row < num_rows && (rows[row].count == 0 || rows[row].length == 0));
    }
  };
  while (next_row < num_rows && (rows[next_row].count == 0 || rows[next_row].length == 0)) {
    ++next_row;
  }
  if (next_row >= num_rows) return;
  const int64_t ahead = std::clamp<int64_t>(kRowPrefetchDistance / rows[next_row].length, 1, 16);
  int64_t row = next_row;
  int64_t chunk = 0;
  for (int64_t k = 0; k < ahead && next_row < num_rows; ++k) advance(next_row, next_chunk);
  bool any_stream = false;
  while (row < num_rows) {
    const ByteRow& r = rows[row];
    const char* src = r.src + chunk * r.src_stride;
    char* dst = r.dst + chunk * r.dst_stride;
    const char* next =
        next_row < num_rows ? rows[next_row].src + next_chunk * rows[next_row].src_stride : nullptr;
    const size_t bytes = static_cast<size_t>(r.length);
    if (stream && bytes >= 64 && ((reinterpret_cast<uintptr_t>(dst) | bytes) & 15) == 0) {
      StreamCopy(dst, src, bytes, next);
      any_stream = true;
    } else {
      PrefetchCopy(dst, src, bytes, next);
    }
    advance(row, chunk);
    if (next_row < num_rows) advance(next_row, next_chunk);
  }
  if (any_stream) StreamFence();
}

void CopyBlocksCpu(const BlockCopyRequest& request) { CopyBlocksCpu(&request, 1); }

void CopyBlocksCpu(const BlockCopyRequest* requests, int64_t count) {
  if (count > kMaxRequests) {  // never from the handlers; keeps the fixed arrays above safe
    for (int64_t first = 0; first < count; first += kMaxRequests) {
      CopyBlocksCpu(requests + first, std::min(kMaxRequests, count - first));
    }
    return;
  }
  int64_t num_pairs = 0;
  int64_t total_bytes = 0;
  for (int64_t r = 0; r < count; ++r) {
    const BlockCopyRequest& request = requests[r];
    num_pairs = std::max(num_pairs, request.num_pairs);
    total_bytes += std::max(request.map.num_runs() * request.map.run_bytes,
                            request.dst_side.block_stride) * request.num_pairs;
  }
  const unsigned threads = ThreadsFor(total_bytes, num_pairs);
  const bool stream = kStreamingStores && total_bytes >= kStreamBytes;
  // Destinations are unique and disjoint from sources (checked by the handlers), so pairs can
  // run in any order.
  ParallelFor(num_pairs, threads,
              [requests, count, stream](unsigned, int64_t first, int64_t last) {
                CopyPairRange(requests, count, first, last, stream);
              });
}

void RewriteBlocksCpu(const BlockRewriteRequest& request) {
  if (request.unit_bytes <= 0 || request.staging_bytes < request.unit_bytes) return;
  const int64_t items = request.num_ids * request.units_per_block;
  const int64_t slots = request.staging_bytes / request.unit_bytes;
  unsigned threads = ThreadsFor(items * request.unit_bytes, items);
  threads = static_cast<unsigned>(std::min<int64_t>(threads, slots));
  // Item k is unit k % units of listed block k / units. Each thread stages a unit in its own
  // slot (hot in its cache) and writes it back rearranged: the block's bytes are read and
  // written once from memory.
  ParallelFor(items, threads, [&request](unsigned thread, int64_t first, int64_t last) {
    char* slot = request.staging + static_cast<int64_t>(thread) * request.unit_bytes;
    for (int64_t item = first; item < last; ++item) {
      const int64_t block = ResolveBlock(request.side, item / request.units_per_block);
      if (block < 0) continue;
      char* unit = request.data + BlockOffset(request.side, block) +
                   (item % request.units_per_block) * request.unit_bytes;
      std::memcpy(slot, unit, static_cast<size_t>(request.unit_bytes));
      CopyRuns(request.map, slot, unit, request.map.run_bytes);
    }
  });
}

}  // namespace jaxkv
