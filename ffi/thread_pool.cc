#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxkv {
namespace {

// More threads than this do not add memory bandwidth on the machines this runs on.
constexpr unsigned kMaxPoolThreads = 8;

// One ParallelFor call. Shared with the queue entries that point at it, so a worker that pops
// an entry after the call returned finds no chunk left and touches nothing else.
struct Batch {
  const std::function<void(unsigned, int64_t, int64_t)>* fn = nullptr;
  int64_t count = 0;
  int64_t chunk_size = 0;
  unsigned chunks = 0;
  std::atomic<unsigned> next{0};  // the next chunk to claim
  std::mutex mutex;
  std::condition_variable finished;
  unsigned done = 0;  // guarded by mutex
  std::exception_ptr error;  // the first exception, guarded by mutex

  // Claims and runs chunks until none is left.
  void Work() {
    while (true) {
      const unsigned chunk = next.fetch_add(1, std::memory_order_relaxed);
      if (chunk >= chunks) return;
      const int64_t first = std::min<int64_t>(count, chunk * chunk_size);
      const int64_t last = std::min<int64_t>(count, first + chunk_size);
      std::exception_ptr thrown;
      try {
        if (first < last) (*fn)(chunk, first, last);
      } catch (...) {
        thrown = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      if (thrown && !error) error = thrown;
      if (++done == chunks) finished.notify_all();
    }
  }
};

class Pool {
 public:
  Pool() {
    const unsigned hardware = std::max(1u, std::thread::hardware_concurrency());
    const unsigned workers = std::min(hardware, kMaxPoolThreads) - 1;
    for (unsigned i = 0; i < workers; ++i) {
      try {
        threads_.emplace_back([this] { Loop(); });
      } catch (...) {
        break;  // fewer workers; callers still run every chunk themselves if need be
      }
    }
  }

  unsigned Threads() const { return static_cast<unsigned>(threads_.size()) + 1; }

  void Run(const std::shared_ptr<Batch>& batch, unsigned helpers) {
    helpers = std::min<unsigned>(helpers, static_cast<unsigned>(threads_.size()));
    if (helpers > 0) {
      try {
        std::lock_guard<std::mutex> lock(mutex_);
        for (unsigned i = 0; i < helpers; ++i) queue_.push_back(batch);
      } catch (...) {
        // Out of memory for queue entries: the caller runs the chunks alone.
      }
      wake_.notify_all();
    }
    batch->Work();
    std::unique_lock<std::mutex> lock(batch->mutex);
    batch->finished.wait(lock, [&] { return batch->done == batch->chunks; });
  }

 private:
  void Loop() {
    while (true) {
      std::shared_ptr<Batch> batch;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return !queue_.empty(); });
        batch = std::move(queue_.front());
        queue_.pop_front();
      }
      batch->Work();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Batch>> queue_;
  std::vector<std::thread> threads_;
};

// Never destroyed: workers block forever on the queue, and joining them from a static
// destructor at exit could deadlock (or run after the handlers' module is unloaded).
Pool& GetPool() {
  static Pool* pool = new Pool();
  return *pool;
}

}  // namespace

unsigned ParallelThreads() { return GetPool().Threads(); }

void ParallelFor(int64_t count, unsigned chunks,
                 const std::function<void(unsigned, int64_t, int64_t)>& fn) {
  if (count <= 0) return;
  if (chunks <= 1 || count == 1) {
    fn(0u, int64_t{0}, count);
    return;
  }
  auto batch = std::make_shared<Batch>();
  batch->fn = &fn;
  batch->count = count;
  batch->chunks = chunks;
  batch->chunk_size = (count + chunks - 1) / chunks;
  GetPool().Run(batch, chunks - 1);
  if (batch->error) std::rethrow_exception(batch->error);
}

}  // namespace jaxkv
