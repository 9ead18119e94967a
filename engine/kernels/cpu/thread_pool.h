// The CPU kernels' threads: one pool for the whole library (the attention and linear kernels
// share it), whose idle threads sleep on a condition variable: the engine's actors share few
// cores, and nothing here may spin for long.
//
// But a decode step is ~150 calls of 10-100 us each, back to back, and a helper woken through
// the condition variable each time arrives after the caller has done most of the call's work
// alone (a futex wake-up on a busy VM costs tens of microseconds): a second thread then gained a
// decode step nothing. So a helper that has just worked watches for the next call for kSpin
// (long enough to bridge the gap between two calls of a step, short against the gap between two
// steps) before it sleeps, and the caller watches for its helpers to finish for as long; an
// idle pool is asleep within kSpin of its last call.
//
// A call's work is `items` independent pieces, handed out one at a time to whichever thread is
// free. The calling thread always works too, and waits at the end only for helpers that joined
// the call: one that has not woken by then (its core busy with another process) finds the task
// withdrawn and goes back to sleep, so a late helper costs the call nothing (an OpenMP team
// would wait for every member at its barrier).

#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace engine_cpu {  // named, not anonymous: every source of the library shares one pool

struct Task {
  void (*run)(const void* context, int64_t item);
  const void* context;
  int64_t items;
  std::atomic<int64_t> next{0};

  void work() {
    for (int64_t item; (item = next.fetch_add(1)) < items;) run(context, item);
  }
};

using Clock = std::chrono::steady_clock;
constexpr auto kSpin = std::chrono::microseconds(50);

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Polls `ready` for up to kSpin; whether it came true.
template <typename Ready>
bool spin_until(Ready ready) {
  const auto deadline = Clock::now() + kSpin;
  for (int polls = 0;; ++polls) {
    if (ready()) return true;
    relax();
    if (polls % 64 == 63 && Clock::now() > deadline) return false;
  }
}

class Pool {
 public:
  void run(Task& task, int helpers) {
    grow(helpers);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      wanted_ = helpers;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();  // no system call when every helper is still spinning
    task.work();
    spin_until([this] { return active_.load(std::memory_order_acquire) == 0; });
    std::unique_lock<std::mutex> lock(mutex_);
    // A helper joins (active_++) and leaves (active_--) under the mutex, and reads task_ only
    // in between: once none is active, withdrawing the task under the same mutex is safe.
    done_.wait(lock, [this] { return active_ == 0; });
    task_ = nullptr;
  }

 private:
  void grow(int helpers) {
    while (started_ < helpers) {
      const int index = started_++;
      std::thread([this, index] { loop(index); }).detach();
    }
  }

  void loop(int index) {
    uint64_t seen = 0;
    for (;;) {
      Task* task;
      spin_until([&] { return generation_.load(std::memory_order_acquire) != seen; });
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (index >= wanted_ || task_ == nullptr) continue;
        task = task_;
        ++active_;
      }
      task->work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--active_ == 0) done_.notify_one();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::condition_variable done_;
  Task* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};  // changed under mutex_, polled outside it
  int wanted_ = 0;
  std::atomic<int> active_{0};  // likewise
  int started_ = 0;
};

// Threads do not survive fork(): a process forked from one that used the pool starts its own
// (the parent's pool object is left behind in the child, never touched). Torch's own OpenMP
// threads hang in such a child anyway; the engine forks its workers from the supervisor, which
// never runs a model. Inline, so the library's sources share this one instance.
inline Pool& pool() {
  static pid_t owner = 0;
  static Pool* instance = nullptr;
  if (instance == nullptr || owner != getpid()) {
    instance = new Pool();
    owner = getpid();
  }
  return *instance;
}

// Runs every item of `task` on up to `threads` threads (the caller and helpers).
inline void run_parallel(Task& task, int threads) {
  const int helpers = static_cast<int>(std::min<int64_t>(threads - 1, task.items - 1));
  if (helpers <= 0) {
    task.work();
    return;
  }
  static std::mutex one_caller;  // the pool serves one call at a time
  std::lock_guard<std::mutex> lock(one_caller);
  pool().run(task, helpers);
}

}  // namespace engine_cpu
