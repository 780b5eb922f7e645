// defines: StatsCounters (a Communicator's live counters), CountingEngine
// (the Engine decorator that counts bytes), OpKindScope (which operation the
// engine traffic on this thread belongs to), track() (times a Work).
//
// The Communicator wraps its engine in a CountingEngine when it is built;
// the algorithms' private engine (Engine::create_subgroup on it) is wrapped
// too and counts into the same counters, so cohort's point-to-point
// algorithms are counted exactly. A subgroup's Communicator unwraps the
// engine it is given and counts into its own counters.
//
// Cost: relaxed atomic adds on counters that the caller's thread mostly
// owns, two reads of tick_clock (the TSC where the kernel trusts it) per
// operation, no locks.
#pragma once

#include <atomic>
#include <memory>

#include "cohort/core/engine.h"
#include "cohort/observability/comm_stats.h"
#include "cohort/observability/trace.h"

namespace cohort {

/// A Communicator's live counters, one Kind per OpKind, updated by CountingEngine and track() with
/// relaxed atomics from any thread. Read them through snapshot() (Communicator::stats()).
struct StatsCounters {
  /// The counters of one operation kind (see OpStats for their meaning).
  struct Kind {
    /// @{
    /// Operations issued and seen complete; bytes sent and received by this rank.
    std::atomic<uint64_t> calls{0}, completed{0}, sent{0}, received{0};
    /// @}
    /// @{
    /// Nanoseconds from issue to observed completion, and blocked inside Work::wait().
    std::atomic<uint64_t> in_flight_ns{0}, waiting_ns{0};
    /// @}
  };
  /// Indexed by OpKind.
  std::array<Kind, kOpKindCount> kinds;
  /// reset() calls so far (CommStats::resets).
  std::atomic<uint64_t> resets{0};
  /// Bytes sent before the last reset(), which CommStats::bytes_sent_ever keeps counting.
  std::atomic<uint64_t> sent_before_resets{0};

  /// The counters of kind `k`.
  Kind& operator[](OpKind k) { return kinds[static_cast<size_t>(k)]; }
  /// A copy of every counter (seconds instead of nanoseconds); not atomic across counters.
  CommStats snapshot() const;
  /// Sets every counter to zero and counts the reset; the bytes sent move to sent_before_resets.
  void reset();
};

/// The kind engine traffic issued on this thread is counted under (Other
/// when no operation is being issued). Set by the Communicator while it
/// issues an operation, and by the algorithms' worker while it runs one.
OpKind current_op_kind();

/// Sets current_op_kind() on this thread for its lifetime and restores the previous kind on
/// destruction.
class OpKindScope {
 public:
  /// Engine traffic issued on this thread is counted under `kind` until the scope ends.
  explicit OpKindScope(OpKind kind);
  ~OpKindScope();
  OpKindScope(const OpKindScope&) = delete;
  OpKindScope& operator=(const OpKindScope&) = delete;

 private:
  OpKind previous_;
};

/// Sets the current kind without restoring it (the Communicator sets it at
/// the start of each operation).
void set_current_op_kind(OpKind kind);

/// An Engine decorator that counts every operation's calls and bytes (per the wire_model for the
/// inner engine's own collectives, exactly for point-to-point) into shared StatsCounters.
class CountingEngine : public Engine {
 public:
  /// Counts `inner`'s traffic into `counters`; prefer wrap(), which does not count twice.
  CountingEngine(std::unique_ptr<Engine> inner, std::shared_ptr<StatsCounters> counters);

  /// `engine` wrapped to count into `counters`; an engine that already
  /// counts (a parent's subgroup) is unwrapped first.
  static std::unique_ptr<Engine> wrap(std::unique_ptr<Engine> engine,
                                      std::shared_ptr<StatsCounters> counters);

  std::string name() const override { return inner_->name(); }
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  WorkPtr all_reduce(at::Tensor& tensor, ReduceOp op) override;
  WorkPtr broadcast(at::Tensor& tensor, int root) override;
  WorkPtr reduce(at::Tensor& tensor, int root, ReduceOp op) override;
  WorkPtr all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override;
  WorkPtr reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op) override;
  bool has_native_reduce_scatter() const override { return inner_->has_native_reduce_scatter(); }
  bool propagates_nan() const override { return inner_->propagates_nan(); }
  bool carries_device_tensors() const override { return inner_->carries_device_tensors(); }
  bool gathers_into_outputs() const override { return inner_->gathers_into_outputs(); }
  WorkPtr gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) override;
  WorkPtr scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) override;
  WorkPtr all_to_all(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_counts,
                     std::vector<int64_t>& input_counts) override;
  WorkPtr barrier() override { return inner_->barrier(); }
  WorkPtr send(at::Tensor& tensor, int dst, int tag) override;
  WorkPtr recv(at::Tensor& tensor, int src, int tag) override;
  /// The subgroup's engine counts into the same counters (the algorithms'
  /// private engine is built this way).
  std::unique_ptr<Engine> create_subgroup(const std::vector<int>& ranks,
                                          std::shared_ptr<Store> store, Millis timeout) override;

 private:
  void count(uint64_t sent, uint64_t received);
  std::unique_ptr<Engine> inner_;
  std::shared_ptr<StatsCounters> counters_;
};

/// Closed forms (per rank, in bytes) of an engine's own collectives; see
/// comm_stats.h. Exposed for the tests.
namespace wire_model {
/// Bytes one rank sends and receives in one operation.
struct Bytes {
  /// @{
  /// Bytes sent and received by the rank.
  uint64_t sent = 0, received = 0;
  /// @}
};
/// A ring all-reduce of `n` bytes: 2 (size - 1) n / size each way; nothing at size 1.
Bytes all_reduce(uint64_t n, int rank, int size);
/// A binomial-tree broadcast of `n` bytes from `root`: n per child sent, n received off the root.
Bytes broadcast(uint64_t n, int rank, int size, int root);
/// A binomial-tree reduce of `n` bytes to `root`: broadcast's figures with sent and received
/// swapped.
Bytes reduce(uint64_t n, int rank, int size, int root);
/// An all-gather of `per_rank` bytes per rank: (size - 1) per_rank each way.
Bytes all_gather(uint64_t per_rank, int rank, int size);
/// A reduce-scatter with `per_rank` bytes of output per rank: the same as all_gather().
Bytes reduce_scatter(uint64_t per_rank, int rank, int size);
}  // namespace wire_model

/// What a traced operation records besides its counters: the tracer (null:
/// not traced), the async span's id and the arguments of its events.
struct OpTrace {
  std::shared_ptr<Tracer> tracer;                ///< null: not traced
  std::chrono::steady_clock::time_point issued;  ///< when the operation was issued
  uint64_t id = 0;                               ///< the async span's id (Tracer::new_id)
  std::vector<TraceArg> args;                    ///< arguments of the in-flight span
};

/// `impl` wrapped so that completing and waiting on it are counted under
/// `kind`; `issued_ticks` (tick_clock::now()) is when the operation was
/// issued. With a tracer, its time in flight becomes an async span
/// ("comm.flight") and each wait() a complete event ("comm.wait"); the
/// counters are then timed with steady_clock from `trace.issued`, so that
/// the trace's totals and the counters come from the same clock reads.
WorkPtr track(WorkPtr impl, std::shared_ptr<StatsCounters> counters, OpKind kind,
              uint64_t issued_ticks, OpTrace trace = {});

}  // namespace cohort
