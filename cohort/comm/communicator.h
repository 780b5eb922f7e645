// defines: Communicator, cohort's process group: collectives and tagged
// point-to-point on torch::Tensor, each returning a Work; subgroups.
//
// Names follow torch.distributed (all_reduce, all_gather_into_tensor,
// reduce_scatter_tensor, all_to_all_single, new_group, ...). Tensors must be
// dense, contiguous CPU tensors of float32, float64, float16, bfloat16, int32,
// int64 or uint8; anything else is refused before a byte is sent.
//
// A communicator is used from one thread at a time per group, and every rank
// of a group must issue the group's collectives in the same order (as in
// torch.distributed). After a timeout or a peer failure the communicator
// refuses further operations: the transport's state is unknown.
#pragma once

#include <torch/types.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/comm/comm_stats.h"
#include "cohort/comm/engine.h"
#include "cohort/comm/store/store.h"
#include "cohort/comm/types.h"
#include "cohort/comm/work.h"

namespace cohort {

class CollectiveChecker;
struct StatsCounters;
namespace algorithms {
class Executor;
}

struct CommunicatorOptions {
  // Timeout of every operation that does not set its own.
  Millis timeout{std::chrono::minutes(30)};
  // Check across ranks, before every collective, that all called the same
  // operation with the same shapes and dtypes (COHORT_DEBUG=detail).
  bool debug_checks = false;
  // Named in error messages.
  std::string name = "world";
  // How all_reduce, reduce_scatter and all_gather run when an operation
  // does not choose (cohort/algorithms/algorithm.h). Default: COHORT_ALGO,
  // else Engine.
  Algorithm algorithm = Algorithm::Default;
  // This rank's node, for the hierarchical algorithm (empty: COHORT_NODE_ID,
  // GROUP_RANK or the host name).
  std::string node;
  // Adaptive calibrates sizes up to this many bytes and extrapolates above
  // (0: COHORT_CALIBRATION_MAX_BYTES, else 64 MiB). A job whose collectives
  // are small can cut its start-up time with it.
  int64_t calibration_max_bytes = 0;
};

class Communicator {
 public:
  Communicator(std::unique_ptr<Engine> engine, std::shared_ptr<Store> store,
               CommunicatorOptions options);
  ~Communicator();

  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return options_.name; }
  std::string backend() const { return engine_->name(); }
  Millis timeout() const { return options_.timeout; }
  const std::shared_ptr<Store>& store() const { return store_; }

  // --- collectives -------------------------------------------------------
  Work all_reduce(torch::Tensor& tensor, const AllReduceOptions& opts = {});
  // Many tensors in one message per dtype (what DDP buckets do by hand).
  Work all_reduce_coalesced(std::vector<torch::Tensor>& tensors,
                            const AllReduceOptions& opts = {});
  Work broadcast(torch::Tensor& tensor, const BroadcastOptions& opts = {});
  Work broadcast_coalesced(std::vector<torch::Tensor>& tensors,
                           const BroadcastOptions& opts = {});
  // The result lands on the root; other ranks' tensors are unspecified after.
  Work reduce(torch::Tensor& tensor, const ReduceOptions& opts = {});
  // outputs[i] receives rank i's input; outputs.size() == size().
  Work all_gather(std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
                  const AllGatherOptions& opts = {});
  // output holds size() inputs back to back (output.numel() == size() * input.numel()).
  Work all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input,
                              const AllGatherOptions& opts = {});
  // output = op over ranks of inputs[rank()]; inputs.size() == size().
  Work reduce_scatter(torch::Tensor& output, const std::vector<torch::Tensor>& inputs,
                      const ReduceScatterOptions& opts = {});
  // input is size() outputs back to back.
  Work reduce_scatter_tensor(torch::Tensor& output, const torch::Tensor& input,
                             const ReduceScatterOptions& opts = {});
  // On the root, outputs[i] receives rank i's input; elsewhere outputs is ignored.
  Work gather(std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
              const GatherOptions& opts = {});
  // On the root, inputs[i] goes to rank i; elsewhere inputs is ignored.
  Work scatter(torch::Tensor& output, const std::vector<torch::Tensor>& inputs,
               const ScatterOptions& opts = {});
  // outputs[i] receives inputs[rank()] of rank i.
  Work all_to_all(std::vector<torch::Tensor>& outputs,
                  const std::vector<torch::Tensor>& inputs, const AllToAllOptions& opts = {});
  // Splits along dim 0 (rows); empty split sizes mean equal splits.
  Work all_to_all_single(torch::Tensor& output, const torch::Tensor& input,
                         std::vector<int64_t> output_split_sizes = {},
                         std::vector<int64_t> input_split_sizes = {},
                         const AllToAllOptions& opts = {});
  Work barrier(const BarrierOptions& opts = {});

  // The algorithm `requested` (Default: the communicator's) resolves to for
  // `op` on a vector of `bytes` (all_gather/reduce_scatter: the gathered
  // size). Adaptive calibrates on first use: collective, like the operation.
  Algorithm resolve_algorithm(Collective op, int64_t bytes,
                              Algorithm requested = Algorithm::Default);
  // Adaptive's measurements and cost model for `op`, as text (calibrates
  // on first use; collective).
  std::string describe_cost_model(Collective op);

  // --- point-to-point ----------------------------------------------------
  Work send(const torch::Tensor& tensor, int dst, const SendOptions& opts = {});
  Work recv(torch::Tensor& tensor, int src, const RecvOptions& opts = {});

  // --- subgroups (collective over this communicator) -----------------------
  // Every rank calls it with the same ranks; members get the group (ranked
  // in the order given), others nullptr.
  std::shared_ptr<Communicator> new_group(const std::vector<int>& ranks);
  // Ranks with the same color form a group, ranked by (key, rank); a
  // negative color joins no group and gets nullptr (MPI_Comm_split).
  std::shared_ptr<Communicator> split(int color, int key);

  // --- statistics (comm_stats.h) -------------------------------------------
  /// A snapshot of this communicator's counters: per operation kind, calls,
  /// bytes sent and received by this rank (including the algorithms'
  /// point-to-point traffic), time in flight and time blocked in wait().
  /// A subgroup counts its own; cheap enough to call every step.
  CommStats stats() const;
  /// Sets every counter to zero.
  void reset_stats();

 private:
  // One operation being issued: its context (for messages) and timeout.
  struct Call {
    OpContext ctx;
    OpKind kind = OpKind::Other;
    std::chrono::steady_clock::time_point issued;
    std::string where() const { return ctx.describe(); }
  };
  Call begin(const std::string& op, Millis timeout, std::vector<int> peers) const;
  Call begin_collective(const std::string& op, Millis timeout) const;
  void debug_check(const Call& call, const std::string& fingerprint);
  Work finish(const Call& call, WorkPtr impl, std::function<void()> on_success = {});
  void check_root(const Call& call, int root) const;
  void check_peer(const Call& call, int peer) const;
  std::shared_ptr<Communicator> make_subgroup(const std::vector<int>& ranks,
                                              const std::string& key_space,
                                              const std::string& name);

  std::shared_ptr<StatsCounters> counters_;  // before engine_: it counts into them
  std::unique_ptr<Engine> engine_;           // a CountingEngine over the transport
  std::shared_ptr<Store> store_;
  CommunicatorOptions options_;
  int rank_;
  int size_;
  std::unique_ptr<CollectiveChecker> checker_;
  uint64_t groups_created_ = 0;

  // Set by the first failed operation, checked by every later one; shared
  // with the Work handles, which may outlive the communicator.
  struct Health;
  std::shared_ptr<Health> health_;

  // Runs the collectives an algorithm other than Engine was chosen for;
  // built at the first one. Last: destroyed (and its thread joined) first.
  algorithms::Executor& algorithms();
  std::unique_ptr<algorithms::Executor> algorithms_;
};

}  // namespace cohort
