// defines: Communicator, cohort's process group: collectives and tagged
// point-to-point on torch::Tensor, each returning a Work; subgroups.
//
// Names follow torch.distributed (all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor, all_to_all_single, new_group, ...). Tensors must be
// dense, contiguous CPU or CUDA tensors of float32, float64, float16,
// bfloat16, int32, int64 or uint8; anything else is refused before a byte
// is sent. CUDA tensors travel through pinned host memory
// (device_staging.h).
//
// A communicator is used from one thread at a time per group, and every rank
// of a group must issue the group's collectives in the same order (as in
// torch.distributed). Operations on the same memory take effect in issue
// order: a collective issued while an earlier one of this communicator
// still reads or writes its bytes first completes that one (in_flight.h). After a timeout or a peer
// failure the communicator refuses further operations: the transport's state is unknown.
#pragma once

#include <torch/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/core/engine.h"
#include "cohort/core/store/store.h"
#include "cohort/core/types.h"
#include "cohort/core/work.h"
#include "cohort/observability/comm_stats.h"
#include "cohort/observability/trace.h"

namespace cohort {

class CollectiveChecker;
struct StatsCounters;
namespace algorithms {
class Executor;
}
namespace detail {
class Access;
class InFlight;
}  // namespace detail

/// A group of ranks that run collectives and point-to-point together (torch.distributed's process
/// group). Built by init() or connect() on every rank; shared between the DDP, ZeRO and Trainer
/// objects that use it. Every operation validates its arguments (cohort::InvalidArgument, nothing
/// sent) and returns a Work; wait() rethrows cohort::TimeoutError or cohort::PeerError, after which
/// the communicator refuses further calls.
class Communicator {
 public:
  /// Wraps a connected engine (counted for stats()). Collective: every rank of the engine
  /// constructs its communicator at the same point, since a non-engine default algorithm connects
  /// here.
  Communicator(std::unique_ptr<Engine> engine, std::shared_ptr<Store> store,
               CommunicatorOptions options);
  ~Communicator();

  /// This process's rank in the group, 0 .. size() - 1.
  int rank() const { return rank_; }
  /// The number of ranks in the group.
  int size() const { return size_; }
  /// The group's name (a subgroup's defaults to "<parent>/g<n>"); used in error messages and store
  /// keys.
  const std::string& name() const { return options_.name; }
  /// The engine's name, e.g. "gloo" or "mpi".
  std::string backend() const { return engine_->name(); }
  /// The default timeout of every operation whose options leave it at kDefaultTimeout.
  Millis timeout() const { return options_.timeout; }
  /// What it was built with, defaults resolved (a copy can build another
  /// communicator over the same ranks: connect()).
  const CommunicatorOptions& options() const { return options_; }
  /// The rendezvous store the group was built over (subgroups get a prefixed one).
  const std::shared_ptr<Store>& store() const { return store_; }
  /// Expires when this communicator is destroyed. It names this communicator
  /// alone: no other compares equivalent to it (std::owner_less), not even
  /// one built later at the same address, for which state kept per
  /// communicator beyond a call (a pending dcp::async_save) is keyed by it.
  std::weak_ptr<const void> lifetime() const { return lifetime_; }

  // --- collectives -------------------------------------------------------
  /// Reduces `tensor` in place over all ranks with opts.op (Avg only on floating dtypes).
  /// Collective.
  Work all_reduce(torch::Tensor& tensor, const AllReduceOptions& opts = {});
  /// Many tensors in one message per dtype (what DDP buckets do by hand).
  Work all_reduce_coalesced(std::vector<torch::Tensor>& tensors,
                            const AllReduceOptions& opts = {});
  /// Copies the root's `tensor` into every rank's `tensor` (same shape and dtype everywhere).
  /// Collective.
  Work broadcast(torch::Tensor& tensor, const BroadcastOptions& opts = {});
  /// Broadcasts several tensors of any dtypes from the root in one message. Collective.
  Work broadcast_coalesced(std::vector<torch::Tensor>& tensors,
                           const BroadcastOptions& opts = {});
  /// The result lands on the root; other ranks' tensors are unspecified after.
  Work reduce(torch::Tensor& tensor, const ReduceOptions& opts = {});
  /// outputs[i] receives rank i's input; outputs.size() == size().
  Work all_gather(std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
                  const AllGatherOptions& opts = {});
  /// output holds size() inputs back to back (output.numel() == size() * input.numel()).
  Work all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input,
                              const AllGatherOptions& opts = {});
  /// output = op over ranks of inputs[rank()]; inputs.size() == size().
  Work reduce_scatter(torch::Tensor& output, const std::vector<torch::Tensor>& inputs,
                      const ReduceScatterOptions& opts = {});
  /// input is size() outputs back to back.
  Work reduce_scatter_tensor(torch::Tensor& output, const torch::Tensor& input,
                             const ReduceScatterOptions& opts = {});
  /// On the root, outputs[i] receives rank i's input; elsewhere outputs is ignored.
  Work gather(std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
              const GatherOptions& opts = {});
  /// On the root, inputs[i] goes to rank i; elsewhere inputs is ignored.
  Work scatter(torch::Tensor& output, const std::vector<torch::Tensor>& inputs,
               const ScatterOptions& opts = {});
  /// outputs[i] receives inputs[rank()] of rank i.
  Work all_to_all(std::vector<torch::Tensor>& outputs,
                  const std::vector<torch::Tensor>& inputs, const AllToAllOptions& opts = {});
  /// Splits along dim 0 (rows); empty split sizes mean equal splits.
  Work all_to_all_single(torch::Tensor& output, const torch::Tensor& input,
                         std::vector<int64_t> output_split_sizes = {},
                         std::vector<int64_t> input_split_sizes = {},
                         const AllToAllOptions& opts = {});
  /// Completes once every rank has called it. Collective. Its wait() also completes every
  /// collective issued on this communicator before it, dropped handles included.
  Work barrier(const BarrierOptions& opts = {});

  /// The algorithm `requested` (Default: the communicator's) resolves to for
  /// `op` on a vector of `bytes` (all_gather/reduce_scatter: the gathered
  /// size). Adaptive calibrates on first use: collective, like the operation.
  Algorithm resolve_algorithm(Collective op, int64_t bytes,
                              Algorithm requested = Algorithm::Default);
  /// Adaptive's measurements and cost model for `op`, as text (calibrates
  /// on first use; collective).
  std::string describe_cost_model(Collective op);

  // --- point-to-point ----------------------------------------------------
  /// Sends `tensor` to rank `dst` (not this rank) under opts.tag >= 0; `tensor` must stay alive and
  /// unchanged until the Work completes.
  Work send(const torch::Tensor& tensor, int dst, const SendOptions& opts = {});
  /// Receives the message from rank `src` with opts.tag into `tensor`, which must match the sent
  /// tensor's size and dtype.
  Work recv(torch::Tensor& tensor, int src, const RecvOptions& opts = {});

  // --- subgroups (collective over this communicator) -----------------------
  /// Every rank calls it with the same ranks; members get the group (ranked
  /// in the order given), others nullptr.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks);
  /// The same with options of its own (algorithm, timeout, debug checks; an
  /// empty name means "<parent>/g<n>"), as torch.distributed.new_group takes
  /// a timeout and pg_options. The group's transport is the parent's.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks,
                                          CommunicatorOptions options);
  /// Ranks with the same color form a group, ranked by (key, rank); a
  /// negative color joins no group and gets nullptr (MPI_Comm_split).
  std::shared_ptr<Communicator> split(int color, int key);

  // --- statistics (cohort/observability/comm_stats.h) --------------------------------
  /// A snapshot of this communicator's counters: per operation kind, calls,
  /// bytes sent and received by this rank (including the algorithms'
  /// point-to-point traffic), time in flight and time blocked in wait().
  /// A subgroup counts its own; cheap enough to call every step.
  CommStats stats() const;
  /// Sets every counter to zero.
  void reset_stats();
  /// This rank's timeline (null unless CommunicatorOptions::trace_dir is
  /// set); the layers above record their events on it through active().
  const std::shared_ptr<Tracer>& tracer() const { return tracer_; }

 private:
  /// One operation being issued: its context (for messages) and timeout.
  struct Call {
    OpContext ctx;
    OpKind kind = OpKind::Other;
    uint64_t issued_ticks = 0;                     // tick_clock, for the counters
    std::chrono::steady_clock::time_point issued;  // for the trace (read only when traced)
    // For the trace: the payload's bytes, the algorithm it ran with, and its
    // place in this group's order (0 when not traced).
    int64_t bytes = 0;
    mutable Algorithm algo = Algorithm::Engine;
    uint64_t seq = 0;
    // A collective's bytes, for the in-flight list (null: not tracked).
    const detail::Access* access = nullptr;
    std::string where() const { return ctx.describe(); }
    /// Throws InvalidArgument "cohort: <where()>: <why>".
    [[noreturn]] void refuse(const std::string& why) const;
  };
  Call begin(const std::string& op, Millis timeout, std::vector<int> peers) const;
  /// A collective's prologue: first completes the earlier collectives whose
  /// bytes `access` conflicts with; finish() then tracks the new one.
  Call begin_collective(const std::string& op, Millis timeout, const detail::Access& access);
  /// The part of begin_collective() that staging runs before it copies.
  void settle(const detail::Access& access);
  /// Tracks a collective's Work in the in-flight list; returns it.
  Work track_in_flight(const detail::Access& access, Work work);
  /// COHORT_DEBUG=detail: every rank must pass the same fingerprint, which is
  /// built only when the check is on.
  template <class Fingerprint>
  void debug_check(const Call& call, Fingerprint&& fingerprint) {
    if (checker_) verify_agreement(call, fingerprint());
  }
  void verify_agreement(const Call& call, const std::string& fingerprint);
  Work finish(const Call& call, WorkPtr impl, std::function<void()> on_success = {});
  /// The Work of a reduction that ran on `buf`: on success, averaged if asked
  /// and copied into `out` (a no-op when `buf` is `out`).
  Work finish_reduction(const Call& call, WorkPtr impl, torch::Tensor out, torch::Tensor buf,
                        ReduceOp op);
  void check_root(const Call& call, int root) const;
  void check_peer(const Call& call, int peer) const;
  /// `list` holds one tensor per rank, each with `ref`'s dtype and shape.
  void check_per_rank(const Call& call, const std::vector<torch::Tensor>& list,
                      const torch::Tensor& ref, const std::string& name) const;
  /// reduce_scatter's two forms after their checks: `chunks` are the ranks'
  /// blocks in the reduction dtype, `flat` the same blocks back to back when
  /// they already are (else undefined).
  Work run_reduce_scatter(const Call& call, torch::Tensor& output,
                          std::vector<torch::Tensor> chunks, torch::Tensor flat,
                          const ReduceScatterOptions& opts);
  /// all_gather's two forms after their checks: one wire-dtype output per
  /// rank, and the same memory as one flat tensor when it is one.
  Work run_all_gather(const Call& call, std::vector<torch::Tensor> outputs, torch::Tensor flat,
                      const torch::Tensor& input, const AllGatherOptions& opts);
  std::shared_ptr<Communicator> make_subgroup(const std::vector<int>& ranks,
                                              const std::string& key_space,
                                              CommunicatorOptions options);

  /// Measures this clock against rank 0's for the trace (collective).
  void align_trace_clock();

  std::shared_ptr<StatsCounters> counters_;  // before engine_: it counts into them
  std::shared_ptr<Tracer> tracer_;           // null when not tracing
  uint64_t trace_seq_ = 0;                   // collectives traced so far
  std::unique_ptr<Engine> engine_;           // a CountingEngine over the transport
  std::shared_ptr<Store> store_;
  CommunicatorOptions options_;
  int rank_;
  int size_;
  bool device_tensors_;  // the engine moves CUDA tensors itself: no staging, no algorithms
  std::unique_ptr<CollectiveChecker> checker_;
  uint64_t groups_created_ = 0;
  std::shared_ptr<const int> lifetime_ = std::make_shared<const int>(0);  // see lifetime()
  std::unique_ptr<detail::InFlight> in_flight_;  // this group's collectives in flight

  /// Set by the first failed operation, checked by every later one; shared
  /// with the Work handles, which may outlive the communicator.
  struct Health;
  std::shared_ptr<Health> health_;

  /// Runs the collectives an algorithm other than Engine was chosen for;
  /// built at the first one. Last: destroyed (and its thread joined) first.
  algorithms::Executor& algorithms();
  std::unique_ptr<algorithms::Executor> algorithms_;
};

}  // namespace cohort
