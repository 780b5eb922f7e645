// defines: then(), an engine operation followed by a completion step
// (copy-out, dtype conversion) that runs once on the waiting thread.
#pragma once

#include <functional>
#include <memory>
#include <mutex>

#include "cohort/core/work.h"

namespace cohort {

class ThenWork : public WorkImpl {
 public:
  ThenWork(std::shared_ptr<WorkImpl> inner, std::function<void()> step)
      : inner_(std::move(inner)), step_(std::move(step)) {}

  bool is_completed() override { return inner_->is_completed(); }

  void wait(Millis timeout) override {
    inner_->wait(timeout);
    std::call_once(done_, step_);
  }

 private:
  std::shared_ptr<WorkImpl> inner_;
  std::function<void()> step_;
  std::once_flag done_;
};

inline std::shared_ptr<WorkImpl> then(std::shared_ptr<WorkImpl> inner, std::function<void()> step) {
  return std::make_shared<ThenWork>(std::move(inner), std::move(step));
}

// An operation that already finished (nothing to send, or world size 1).
class DoneWork : public WorkImpl {
 public:
  bool is_completed() override { return true; }
  void wait(Millis) override {}
};

// Shared: a DoneWork has no state, and small operations should not pay an
// allocation for it.
inline std::shared_ptr<WorkImpl> done_work() {
  static const std::shared_ptr<WorkImpl> done = std::make_shared<DoneWork>();
  return done;
}

}  // namespace cohort
