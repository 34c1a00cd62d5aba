// A process-wide pool of worker threads for the CPU engine. XLA calls the handlers from its own
// threads (several at once for concurrent programs); spawning threads per call costs tens of
// microseconds each and, under load, can fail. The pool is created on first use, sized to the
// machine, and never torn down (workers sleep when idle).
#ifndef JAXKV_FFI_THREAD_POOL_H_
#define JAXKV_FFI_THREAD_POOL_H_

#include <cstdint>
#include <functional>

namespace jaxkv {

// Splits items [0, count) into `chunks` contiguous ranges (the last ones may be empty) and runs
// fn(chunk, first, last) for each, on the calling thread and idle pool workers, returning when
// every range is done. Each chunk index runs on exactly one thread, so `chunk` may select
// per-thread scratch. The caller claims chunks too, so the call completes even when every
// worker is busy (or none could be started). An exception thrown by `fn` is rethrown here once
// all chunks have finished.
void ParallelFor(int64_t count, unsigned chunks,
                 const std::function<void(unsigned, int64_t, int64_t)>& fn);

// Threads that ParallelFor can use at once: the caller plus the pool's workers (at least 1).
unsigned ParallelThreads();

}  // namespace jaxkv

#endif  // JAXKV_FFI_THREAD_POOL_H_
