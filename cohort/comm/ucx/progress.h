// defines: Progress, the Worker's part that drives UCX: the waiting thread
// polls ucp_worker_progress for COHORT_UCX_SPIN_US (default 100 us), then
// sleeps; the engine's thread sleeps between jobs (README.md, "Progress").
//
// Locking rule:
// - Every member is an atomic or is guarded by the one mutex beside it:
//   idle_mu_ guards idle_generation_ (the engine's thread's sleep), wake_mu_
//   only orders a sleeper's predicate against a completion's notify. Neither
//   is held while UCX is called, nor while another part's lock is taken.
// - One thread at a time sleeps on the worker's event fd (sleeper_): arming
//   drains the fd, so two sleepers could swallow each other's wake-up.
// - completed() runs inside UCX's progress (a completion callback, under
//   UCX's worker lock): it takes wake_mu_ only while a thread sleeps on
//   wake_ (blocked_, fenced against the sleeper's check of `done`), since it
//   is on the critical path of every small collective.
// - Any thread may call any member; the engine's thread alone calls idle().
#pragma once

#include <ucp/api/ucp.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>

#include "cohort/comm/ucx/transfer.h"
#include "cohort/core/types.h"

namespace cohort::ucx {

class Progress {
 public:
  // At or above this size a posted transfer wakes the engine's thread.
  static constexpr size_t kWakeBytes = 64 << 10;

  void attach(ucp_worker_h worker, int event_fd) {
    worker_ = worker;
    event_fd_ = event_fd;
  }

  // Progresses UCX once; true when something happened.
  bool poll() { return ucp_worker_progress(worker_) != 0; }

  // Drives UCX until `done` or `deadline` (false: the deadline passed).
  // Calls `look()` (which may throw) once per kPollsPerLook idle polls: a
  // clock read costs about as much as an idle poll, and a 1 KiB all-reduce
  // waits for a few polls, so the notices, the check and the clock are
  // looked at every few microseconds rather than after each poll.
  template <class Look>
  bool drive(const std::atomic<bool>& done, Clock::time_point deadline, Look&& look);

  // A transfer was posted: `counted` (not a control message) until
  // completed(); one of kWakeBytes or more wakes the engine's thread, unless
  // a thread drives UCX already.
  void posted(bool counted) {
    if (counted) pending_.fetch_add(1, std::memory_order_acq_rel);
  }
  void hand_over(size_t bytes) {
    if (bytes >= kWakeBytes && waiters_.load(std::memory_order_acquire) == 0) wake_idle();
  }
  // Called by UCX's completion callbacks.
  void completed(bool counted);

  // The engine's thread between jobs, after a poll that found nothing:
  // sleeps at most `most`, on the event fd while transfers are pending and
  // nobody waits (otherwise an armed fd costs a wake-up per message).
  void idle_sleep(Millis most);
  // Wakes the threads sleeping in idle_sleep or drive.
  void signal();

  // While one lives, this thread drives UCX: posts do not wake the engine's
  // thread, and idle_sleep() does not arm the event fd.
  class Driving {
   public:
    explicit Driving(Progress& p) : n_(p.waiters_) { n_.fetch_add(1, std::memory_order_acq_rel); }
    ~Driving() { n_.fetch_sub(1, std::memory_order_acq_rel); }
    Driving(const Driving&) = delete;
    Driving& operator=(const Driving&) = delete;

   private:
    std::atomic<int>& n_;
  };

 private:
  static constexpr unsigned kPollsPerLook = 16;
  static int spin_us();
  // Sleeps until `done` (if given), an event, or `most`.
  void block(const std::atomic<bool>* done, Millis most);
  void wake_all();   // the threads waiting for a completion
  void wake_idle();  // the engine's thread in idle_sleep()

  ucp_worker_h worker_ = nullptr;
  int event_fd_ = -1;
  std::atomic<bool> sleeper_{false};  // a thread sleeps on event_fd_
  std::atomic<int> waiters_{0};       // threads inside drive() or Driving
  std::atomic<int> blocked_{0};       // threads asleep on wake_ in block()
  std::atomic<int> pending_{0};       // posted transfers not yet complete (not control)
  std::mutex idle_mu_;
  std::condition_variable idle_;
  uint64_t idle_generation_ = 0;  // under idle_mu_: bumped by wake_idle
  std::mutex wake_mu_;
  std::condition_variable wake_;
};

template <class Look>
bool Progress::drive(const std::atomic<bool>& done, Clock::time_point deadline, Look&& look) {
  Driving driving(*this);
  unsigned polls = 0;
  Clock::time_point spin_until{};
  while (!done.load(std::memory_order_acquire)) {
    if (poll() || ++polls % kPollsPerLook != 1) continue;
    look();
    const auto now = Clock::now();
    if (polls == 1) spin_until = now + std::chrono::microseconds(spin_us());
    if (now >= deadline) return false;
    if (now < spin_until) continue;
    // Sleep in slices, so a peer's notice is seen within 100 ms.
    block(&done, std::min(std::chrono::duration_cast<Millis>(deadline - now), Millis(100)));
  }
  return true;
}

}  // namespace cohort::ucx
