#include "cohort/comm/ucx/progress.h"

#include <poll.h>

#include "cohort/core/env.h"

namespace cohort::ucx {

// How long a waiter polls before it sleeps on the event fd: a reply within
// this is taken at polling latency, a longer wait costs no CPU.
int Progress::spin_us() {
  static const int us = env::get_int("COHORT_UCX_SPIN_US", 0, 1000000).value_or(100);
  return us;
}

// One thread at a time sleeps on UCX's event fd: arming drains the fd, so a
// second sleeper could swallow the first one's wake-up. The others wait for
// a completion callback (wake_all) or for the sleeper's turn to end.
void Progress::block(const std::atomic<bool>* done, Millis most) {
  auto finished = [&] { return done && done->load(std::memory_order_acquire); };
  if (!sleeper_.exchange(true, std::memory_order_acq_rel)) {
    // Busy: events arrived since the last progress; the caller progresses.
    if (!finished() && !poll() && ucp_worker_arm(worker_) == UCS_OK) {
      pollfd fd{event_fd_, POLLIN, 0};
      ::poll(&fd, 1, static_cast<int>(std::max<Millis::rep>(most.count(), 1)));
    }
    sleeper_.store(false, std::memory_order_release);
    wake_all();  // a waiter may take over the fd
    return;
  }
  // Counted before the predicate is read, so that completed() either sees
  // this sleeper or its `done` is seen here (both sides fence).
  blocked_.fetch_add(1, std::memory_order_seq_cst);
  std::atomic_thread_fence(std::memory_order_seq_cst);
  {
    std::unique_lock<std::mutex> lock(wake_mu_);
    wake_.wait_for(lock, most, [&] { return finished() || !sleeper_.load(); });
  }
  blocked_.fetch_sub(1, std::memory_order_release);
}

void Progress::wake_all() {
  std::unique_lock<std::mutex> lock(wake_mu_);
  lock.unlock();
  wake_.notify_all();
}

void Progress::completed(bool counted) {
  // Counted when posted (posted() runs after the post, so this may run first).
  if (counted) pending_.fetch_sub(1, std::memory_order_acq_rel);
  // Only a thread asleep on the condition variable needs the lock and the
  // notify: a spinning waiter sees `done` itself.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (blocked_.load(std::memory_order_relaxed) > 0) wake_all();
}

void Progress::wake_idle() {
  {
    std::lock_guard<std::mutex> lock(idle_mu_);
    ++idle_generation_;
  }
  idle_.notify_all();
}

void Progress::idle_sleep(Millis most) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  const auto generation = idle_generation_;
  if (waiters_.load(std::memory_order_acquire) == 0 &&
      pending_.load(std::memory_order_acquire) > 0) {
    lock.unlock();
    block(nullptr, most);
    return;
  }
  idle_.wait_for(lock, most, [&] { return idle_generation_ != generation; });
}

void Progress::signal() {
  ucp_worker_signal(worker_);
  wake_all();
  wake_idle();
}

}  // namespace cohort::ucx
