// defines: Work (the handle every operation returns), WorkImpl (what engines
// implement), OpContext (what an error message names), completed_work.
//
// Every operation is asynchronous. Work::wait(timeout) blocks until the
// operation finished, then runs its completion step (copy-out, averaging) on
// the waiting thread, or rethrows the operation's error with the operation,
// the rank and the peers in the message. A timeout is an error, never a hang.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

namespace detail {
class InFlight;
}

/// What an error message says about an operation.
struct OpContext {
  std::string op;          ///< "all_reduce", "send", ...
  std::string group;       ///< "world" or the subgroup's name
  int rank = 0;            ///< caller's rank in `group`
  int size = 1;            ///< size of `group`
  std::vector<int> peers;  ///< ranks (in `group`) the operation talks to
  /// Set instead of `peers` by collectives: every other rank of the group
  /// (a list built only when a message needs it, not on every call).
  bool all_peers = false;
  /// Whether the debug checks (COHORT_DEBUG=detail) ran before this
  /// collective; when not, a collective's error suggests turning them on.
  bool debug_checks = false;
  /// Whether the engine moves CUDA tensors itself (NCCL): the tensor
  /// checks then accept them as they accept CPU tensors.
  bool device_tensors = false;
  Millis timeout{0};  ///< resolved timeout of this operation

  /// "all_reduce on rank 0 of 4 (group world, peers [1, 2, 3])"
  std::string describe() const;
};

/// The engine-side half of an operation.
class WorkImpl {
 public:
  virtual ~WorkImpl() = default;
  /// Non-blocking: true once the operation succeeded or failed.
  virtual bool is_completed() = 0;
  /// Blocks until the operation finished or `timeout` passed. Throws
  /// TimeoutError on timeout, PeerError (or another Error) on failure.
  virtual void wait(Millis timeout) = 0;
};

/// Several engine operations that together make one cohort operation.
class WorkList : public WorkImpl {
 public:
  /// Completes when every part has; wait() waits on the parts in order within one overall timeout.
  explicit WorkList(std::vector<std::shared_ptr<WorkImpl>> parts);
  bool is_completed() override;
  void wait(Millis timeout) override;

 private:
  std::vector<std::shared_ptr<WorkImpl>> parts_;
};

/// The handle every cohort operation returns (torch.distributed's Work). Copies share one
/// operation. Waiting is required before the result tensors are read: wait() also runs the
/// completion step (copy-out, averaging) and rethrows TimeoutError, PeerError or MismatchError
/// naming the operation, the rank and the peers. [[nodiscard]]: a collective whose handle is
/// dropped completes only at the communicator's next call after it finished, or at its next
/// barrier (comm/README.md); cast to void where that is meant.
class [[nodiscard]] Work {
 public:
  /// Called once with the error message when the operation fails; the
  /// communicator uses it to refuse further operations.
  using FailureHook = std::function<void(const std::string&)>;

  /// A handle to an operation that has nothing left to do.
  Work();
  /// Wraps an engine operation: `on_success` runs once on the thread that first sees it complete,
  /// `on_failure` once with the message when it fails.
  Work(std::shared_ptr<WorkImpl> impl, OpContext context, std::function<void()> on_success = {},
       FailureHook on_failure = {});

  /// Waits up to the operation's own timeout.
  void wait();
  /// Waits up to `timeout`; rethrows the operation's error.
  void wait(Millis timeout);
  /// Non-blocking; runs the completion step when the operation has finished.
  bool is_completed();
  /// A handle that waits for this operation, then runs `step` once on the
  /// waiting thread (a copy back to a device); this operation's errors
  /// come through it as they are.
  Work then(std::function<void()> step) const;

 private:
  struct State;
  void finish(State& s, Millis timeout);
  // The communicator's list of collectives in flight reads whether an
  // operation finished and whether only it still holds the handle.
  friend class detail::InFlight;
  /// Whether wait() or is_completed() finished it (or it had nothing to do); never blocks.
  bool finished() const;
  /// How many handles share the operation.
  long handles() const { return state_.use_count(); }
  std::shared_ptr<State> state_;
};

/// Waits for every handle in order (each with its own timeout).
void wait_all(std::vector<Work>& works);

}  // namespace cohort
