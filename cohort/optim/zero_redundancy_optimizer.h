// defines: ZeroOptions, ZeroRedundancyOptimizer (ZeRO stages 1 and 2,
// Rajbhandari et al. 2020): each rank keeps the optimizer state of 1/N of the
// parameters (stage 1) and, at stage 2, only the averaged gradients of that
// 1/N as well.
//
//   auto zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
//       model->parameters(), torch::optim::AdamWOptions(1e-3), comm, {.stage = 2});
//   for (...) { zero->zero_grad(); loss(model).backward(); zero->step(); }
//
// The parameters are laid end to end in one flat buffer (the parameters
// become views into it) and partitioned with FlatPartition. A LibTorch
// optimizer of the caller's type (AdamW, Adam, SGD, ...) is built over this
// rank's pieces only, one group per caller group with the caller's options,
// so it holds 1/N of the state. One step:
//   gradients  stage 1 alone: all-reduce (Avg) bucket by bucket into a full
//                flat gradient buffer, then read this rank's slices;
//              stage 1 after cohort DDP (reduce_gradients = false): read the
//                slices of the already averaged .grad, no communication;
//              stage 2: hooks stage each gradient in a flat buffer during
//                backward (the .grad are views into it) and reduce-scatter
//                (Avg) each full bucket into this rank's gradient shard while
//                backward goes on; the step releases the staging buffer, so
//                only the shard outlives the step. One backward per step.
//              world 1 (either stage): slices of .grad, no copies.
//   update     the inner optimizer steps its pieces (in the flat buffer);
//   parameters all-gather every bucket, so all ranks hold the new values.
// reduce-scatter + all-gather move as many bytes as one all-reduce, so
// stage 2 costs the communication volume of plain data parallelism.
//
// Every element is updated by the same element-wise formula as in the
// unsharded optimizer, so results equal DDP + the same optimizer (to
// rounding). Requirements: all parameters one floating dtype, dense, CPU.
#pragma once

#include <torch/optim/optimizer.h>
#include <torch/serialize/archive.h>
#include <torch/types.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/optim/flat_partition.h"

namespace cohort {

struct ZeroOptions {
  // 1: optimizer state sharded; 2: gradients sharded as well.
  int stage = 1;
  // Largest bucket of the gradient reduction and the parameter all-gather,
  // in MiB; smaller buckets mean less staging memory at stage 2.
  double bucket_cap_mb = 25;
  // Stage 1 only: false when the gradients were already averaged over the
  // ranks (cohort DDP's all-reduce ran in backward); true reduces them here.
  bool reduce_gradients = true;
};

class ZeroRedundancyOptimizer {
 public:
  // Builds the inner optimizer over this rank's shard, from the shard's
  // parameter groups (each with the caller's group options already set).
  using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(
      std::vector<torch::optim::OptimizerParamGroup>)>;

  // Collective over comm: every rank passes the same parameter shapes in
  // the same order. Parameters must already be equal on all ranks (as after
  // DDP's broadcast); groups without options take the inner defaults.
  ZeroRedundancyOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups, Factory factory,
                          std::shared_ptr<Communicator> comm, ZeroOptions options = {});
  // Removes the stage-2 gradient hooks from the parameters.
  ~ZeroRedundancyOptimizer();
  // The hooks hold this object's address.
  ZeroRedundancyOptimizer(const ZeroRedundancyOptimizer&) = delete;
  ZeroRedundancyOptimizer& operator=(const ZeroRedundancyOptimizer&) = delete;

  // ZeroRedundancyOptimizer::make<torch::optim::AdamW>(params, AdamWOptions(lr), comm)
  template <typename Opt, typename Options>
  static std::unique_ptr<ZeroRedundancyOptimizer> make(
      std::vector<torch::optim::OptimizerParamGroup> groups, const Options& defaults,
      std::shared_ptr<Communicator> comm, ZeroOptions options = {}) {
    return std::make_unique<ZeroRedundancyOptimizer>(
        std::move(groups),
        [defaults](std::vector<torch::optim::OptimizerParamGroup> shard) {
          return std::make_unique<Opt>(std::move(shard), defaults);
        },
        std::move(comm), options);
  }
  template <typename Opt, typename Options>
  static std::unique_ptr<ZeroRedundancyOptimizer> make(std::vector<torch::Tensor> params,
                                                       const Options& defaults,
                                                       std::shared_ptr<Communicator> comm,
                                                       ZeroOptions options = {}) {
    std::vector<torch::optim::OptimizerParamGroup> groups;
    groups.emplace_back(std::move(params));
    return make<Opt>(std::move(groups), defaults, std::move(comm), options);
  }

  // Collective: reduce gradients as the stage says, step the shard,
  // all-gather the updated parameters.
  void step();
  // Releases the parameters' gradients (set to none, as LibTorch 2.x).
  void zero_grad();
  // Sets the rate of every group (as setting each group's lr in LibTorch).
  void set_lr(double lr);

  // The inner optimizer's groups, index for index the caller's groups: their
  // options (lr, weight decay, betas, ...) can be changed as in LibTorch.
  std::vector<torch::optim::OptimizerParamGroup>& param_groups();
  torch::optim::Optimizer& shard_optimizer() { return *inner_; }
  const FlatPartition& partition() const { return *partition_; }
  const ZeroOptions& options() const { return options_; }
  Communicator& communicator() { return *comm_; }

  // Bytes of optimizer state this rank holds (its shard's).
  int64_t state_bytes() const;
  // The gradient storage this optimizer keeps between steps, and its bytes:
  // the full flat buffer at stage 1 alone, the shard at stage 2, nothing
  // at stage 1 after DDP (DDP's buffers hold them) or at world 1 (.grad).
  std::vector<torch::Tensor> grad_buffers() const;
  int64_t grad_bytes() const;

  // This rank's shard of the state, for sharded checkpoints: every rank
  // saves its own archive and loads it back into an optimizer with the same
  // world size, rank and parameter shapes (checked: MismatchError).
  void save_shard(torch::serialize::OutputArchive& archive) const;
  void load_shard(torch::serialize::InputArchive& archive);

  // Collective: gathers every rank's shard of each state tensor to rank
  // `to`, which returns, per parameter, name -> full tensor shaped like the
  // parameter ("exp_avg", "exp_avg_sq", "momentum_buffer", ...; plus "step"
  // as a one-element int64 tensor where the state has one). Other ranks
  // return an empty vector. Parameters never stepped have an empty map.
  std::vector<std::map<std::string, torch::Tensor>> consolidate_state_dict(int to = 0);

 private:
  void reduce_gradients();
  void all_reduce_gradients();
  void all_gather_parameters();
  std::vector<char> globally_has_grad();
  std::vector<char> globally_has_grad_from(const std::vector<char>& local);
  // Stage 2 (zero_checkpoint.cpp has none of it).
  void begin_iteration();
  torch::Tensor on_gradient(size_t i, const torch::Tensor& grad);
  void stage_param(size_t i);
  void launch_ready_buckets(bool all);
  void reduce_scatter_gradients();
  std::string where(const std::string& op) const;

  std::shared_ptr<Communicator> comm_;
  ZeroOptions options_;
  std::vector<torch::Tensor> params_;  // flat order
  std::unique_ptr<FlatPartition> partition_;
  torch::Tensor flat_params_;  // padded; the parameters are views into it
  torch::Tensor flat_grads_;   // stage 1 with reduce_gradients: padded
  torch::Tensor shard_grads_;  // stage 2: this rank's shard
  // One leaf tensor per piece, a view into flat_params_ (what the inner
  // optimizer steps), in partition().pieces() order.
  std::vector<torch::Tensor> pieces_;
  std::unique_ptr<torch::optim::Optimizer> inner_;

  // Stage 2 bookkeeping: parameters of each bucket and buckets of each
  // parameter; per iteration the staging buffer (the .grad are views into
  // it), which parameters came in, what each bucket still waits for, the
  // next bucket to launch (launched from the last down) and its Work.
  std::vector<std::vector<size_t>> bucket_params_, param_buckets_;
  std::vector<int> pending_init_, pending_;
  std::vector<char> seen_;
  torch::Tensor staging_;
  std::vector<Work> rs_work_;
  int64_t next_launch_ = -1;
  bool twice_ = false;
  std::vector<std::pair<size_t, unsigned>> hooks_;  // (parameter, hook key)
};

}  // namespace cohort
