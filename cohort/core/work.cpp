#include "cohort/core/work.h"

#include <algorithm>
#include <atomic>
#include <mutex>
#include <sstream>

#include "cohort/core/error.h"

namespace cohort {

std::string OpContext::describe() const {
  std::ostringstream os;
  os << op << " on rank " << rank << " of " << size << " (group " << group;
  std::vector<int> peers = this->peers;
  if (all_peers) {
    for (int r = 0; r < size; ++r) {
      if (r != rank) peers.push_back(r);
    }
  }
  if (!peers.empty()) {
    os << (peers.size() == 1 ? ", peer " : ", peers [");
    const size_t shown = std::min<size_t>(peers.size(), 8);
    for (size_t i = 0; i < shown; ++i) os << (i ? ", " : "") << peers[i];
    if (peers.size() > shown) os << ", ... " << peers.back();
    if (peers.size() != 1) os << "]";
  }
  os << ")";
  return os.str();
}

WorkList::WorkList(std::vector<std::shared_ptr<WorkImpl>> parts) : parts_(std::move(parts)) {}

bool WorkList::is_completed() {
  return std::all_of(parts_.begin(), parts_.end(), [](auto& p) { return p->is_completed(); });
}

void WorkList::wait(Millis timeout) {
  // One deadline for the whole list, not `timeout` per part.
  auto deadline = std::chrono::steady_clock::now() + timeout;
  for (auto& p : parts_) {
    auto left = std::chrono::duration_cast<Millis>(deadline - std::chrono::steady_clock::now());
    p->wait(std::max(left, Millis(1)));
  }
}

struct Work::State {
  std::shared_ptr<WorkImpl> impl;
  OpContext context;
  std::function<void()> on_success;
  FailureHook on_failure;

  // A then() handle: its impl is another Work, whose errors already name
  // the operation.
  bool chained = false;

  std::mutex mu;
  // Written under `mu`; read without it by the communicator's in-flight list.
  std::atomic<bool> finished{false};
  std::exception_ptr error;
};

Work::Work() = default;

Work::Work(std::shared_ptr<WorkImpl> impl, OpContext context, std::function<void()> on_success,
           FailureHook on_failure)
    : state_(std::make_shared<State>()) {
  state_->impl = std::move(impl);
  state_->context = std::move(context);
  state_->on_success = std::move(on_success);
  state_->on_failure = std::move(on_failure);
}

void Work::wait() {
  if (!state_) return;
  wait(state_->context.timeout);
}

namespace {

// Rebuilds `e` with the operation's context in front, keeping its type so
// callers can catch TimeoutError or PeerError specifically.
std::exception_ptr with_context(const OpContext& ctx, Millis timeout) {
  const std::string where = "cohort: " + ctx.describe();
  // Ranks that called different collectives (or one with other sizes,
  // dtypes or ops) surface as timeouts or transport errors; the debug
  // checks name the difference.
  const std::string hint =
      ctx.all_peers && !ctx.debug_checks
          ? " (if the ranks may have called different collectives, or one with different "
            "sizes, dtypes or ops, rerun with COHORT_DEBUG=detail to find out)"
          : "";
  try {
    throw;
  } catch (const TimeoutError& e) {
    return std::make_exception_ptr(TimeoutError(
        where + " timed out after " + std::to_string(timeout.count()) + " ms: " + e.what() + hint));
  } catch (const PeerError& e) {
    return std::make_exception_ptr(PeerError(where + " failed: " + e.what() + hint));
  } catch (const MismatchError& e) {
    return std::make_exception_ptr(MismatchError(where + ": " + e.what()));
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Error(where + " failed: " + e.what() + hint));
  }
}

std::string message_of(const std::exception_ptr& p) {
  try {
    std::rethrow_exception(p);
  } catch (const std::exception& e) {
    return e.what();
  }
}

}  // namespace

void Work::finish(State& s, Millis timeout) {
  try {
    try {
      s.impl->wait(timeout);
    } catch (...) {
      if (!s.chained) throw;
      s.error = std::current_exception();
    }
    if (!s.error && s.on_success) s.on_success();
  } catch (...) {
    s.error = with_context(s.context, timeout);
    if (s.on_failure) s.on_failure(message_of(s.error));
  }
  // Done: the buffers the operation and its completion step hold go now,
  // not with the last handle (the communicator's in-flight list holds one
  // until its next call). A failed operation keeps them: the transport may
  // still be writing into them.
  if (!s.error) {
    s.impl.reset();
    s.on_success = nullptr;
  }
  s.finished = true;
}

void Work::wait(Millis timeout) {
  if (!state_) return;
  std::lock_guard<std::mutex> lock(state_->mu);
  if (!state_->finished) finish(*state_, timeout);
  if (state_->error) std::rethrow_exception(state_->error);
}

bool Work::finished() const { return !state_ || state_->finished.load(); }

bool Work::is_completed() {
  if (!state_) return true;
  std::lock_guard<std::mutex> lock(state_->mu);
  if (state_->finished) return true;
  if (!state_->impl->is_completed()) return false;
  // The engine is done: the wait below returns at once; it runs the
  // completion step or records the error for the next wait().
  finish(*state_, Millis(1));
  return true;
}

namespace {

// then()'s engine half: the Work it follows.
class AfterWork : public WorkImpl {
 public:
  explicit AfterWork(Work inner) : inner_(std::move(inner)) {}
  bool is_completed() override { return inner_.is_completed(); }
  void wait(Millis timeout) override { inner_.wait(timeout); }

 private:
  Work inner_;
};

}  // namespace

Work Work::then(std::function<void()> step) const {
  Work out(std::make_shared<AfterWork>(*this), state_ ? state_->context : OpContext{},
           std::move(step));
  out.state_->chained = true;
  return out;
}

void wait_all(std::vector<Work>& works) {
  for (auto& w : works) w.wait();
}

}  // namespace cohort
