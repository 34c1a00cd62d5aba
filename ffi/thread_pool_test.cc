// Standalone checks of the CPU engine's thread pool (no XLA): every item runs exactly once,
// concurrent callers share the pool, an exception thrown in a chunk reaches the caller after
// all chunks finished, and the pool keeps working afterwards. Built and run by
// scripts/sanitize.sh under AddressSanitizer and UndefinedBehaviorSanitizer.
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "thread_pool.h"

namespace {

void Check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "thread_pool_test FAILED: %s\n", what);
    std::exit(1);
  }
}

void EveryItemOnce(int64_t count, unsigned chunks) {
  std::vector<std::atomic<int>> seen(static_cast<size_t>(count));
  std::vector<std::atomic<int>> chunk_calls(chunks);
  jaxkv::ParallelFor(count, chunks, [&](unsigned chunk, int64_t first, int64_t last) {
    chunk_calls[chunk].fetch_add(1);
    for (int64_t i = first; i < last; ++i) seen[static_cast<size_t>(i)].fetch_add(1);
  });
  for (auto& s : seen) Check(s.load() == 1, "an item ran other than once");
  for (auto& c : chunk_calls) Check(c.load() <= 1, "a chunk ran twice");
}

}  // namespace

int main() {
  Check(jaxkv::ParallelThreads() >= 1, "no threads");
  for (unsigned chunks : {1u, 2u, 3u, 8u, 64u}) {
    for (int64_t count : {int64_t{1}, int64_t{2}, int64_t{7}, int64_t{1000}}) {
      EveryItemOnce(count, chunks);
    }
  }
  // Concurrent callers (as XLA's threads are).
  std::vector<std::thread> callers;
  for (int t = 0; t < 8; ++t) {
    callers.emplace_back([] {
      for (int i = 0; i < 200; ++i) EveryItemOnce(97, 8);
    });
  }
  for (auto& caller : callers) caller.join();
  // An exception in one chunk: rethrown once every chunk is done.
  std::atomic<int> finished{0};
  bool caught = false;
  try {
    jaxkv::ParallelFor(8, 8, [&](unsigned chunk, int64_t, int64_t) {
      if (chunk == 3) throw std::runtime_error("chunk 3");
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      finished.fetch_add(1);
    });
  } catch (const std::runtime_error& e) {
    caught = std::string(e.what()) == "chunk 3";
  }
  Check(caught, "the chunk's exception did not reach the caller");
  Check(finished.load() == 7, "the caller returned before the other chunks finished");
  EveryItemOnce(1000, 8);  // still usable
  std::printf("thread_pool_test OK (%u threads)\n", jaxkv::ParallelThreads());
  return 0;
}
