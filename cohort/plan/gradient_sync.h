// defines: GradientSync (what the trainer needs from data parallelism) and
// AllReduceGradientSync (averages gradients after backward with one
// coalesced all-reduce; for models not wrapped in DDP, and for tests).
//
// The trainer runs k micro-batches per optimizer step. Only the last one's
// backward must communicate: earlier ones accumulate into .grad locally.
// DDP does that with no_sync() during backward (cohort/ddp/ddp_gradient_sync.h);
// the all-reduce fallback does it after the final backward. LocalGradientSync
// is for gradients that need no averaging (one data-parallel replica: a
// pipeline alone).
#pragma once

#include <torch/types.h>

#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace cohort {

class Communicator;

/// How the Trainer averages gradients across ranks over a step's micro-batches.
class GradientSync {
 public:
  virtual ~GradientSync() = default;
  /// A guard held across a non-final micro-batch's forward and backward:
  /// while it lives, backward must not communicate. May return nullptr.
  virtual std::shared_ptr<void> skip_sync() = 0;
  /// Called after the final micro-batch's backward. On return every rank
  /// holds the average over ranks of the accumulated gradients.
  virtual void finish_sync() = 0;
  /// finish_sync() after a layout's step that may have thrown on some ranks
  /// and sends nothing over the sync's groups (a pipeline's: its ranks learn
  /// of a failure at the step's end, the other replicas learn here).
  /// `failed`: the exception this rank's step threw, null where it ran. When
  /// some rank's step threw, every rank throws before anything is averaged
  /// (that exception where it was thrown, one of its kind naming it on the
  /// others) and drops its gradients. This default tells no other rank: it
  /// rethrows `failed`, else finish_sync().
  virtual void finish_sync_unless_failed(const std::exception_ptr& failed) {
    if (failed) std::rethrow_exception(failed);
    finish_sync();
  }
  /// Seconds spent in gradient communication since construction.
  virtual double comm_seconds() const = 0;
  /// True when the synchronization keeps per-rank state a resumed run needs
  /// (a compressor's error feedback): the trainer then saves each rank's
  /// state() in the checkpoint's dcp folder and hands it back to the same
  /// rank with load_state(). The same on every rank.
  virtual bool has_state() const { return false; }
  /// This rank's state (when has_state()) as named tensors.
  virtual std::map<std::string, torch::Tensor> state() const { return {}; }
  /// Restores what state() returned on the same rank of an earlier run
  /// (empty: the state of a sync that has not run yet).
  virtual void load_state(const std::map<std::string, torch::Tensor>& state) { (void)state; }
  /// Throws (ConfigError, naming this rank) when load_state(state) would
  /// refuse `state`; changes nothing. The trainer calls it before anything
  /// of a checkpoint is loaded.
  virtual void check_state(const std::map<std::string, torch::Tensor>& state) const { (void)state; }
};

/// A GradientSync for a model without DDP: one all-reduce (average) of the gradients after the last
/// micro-batch.
class AllReduceGradientSync : public GradientSync {
 public:
  /// Averages the gradients of `params` over `comm` (average_gradients: a frozen parameter, or
  /// one without a gradient on every rank, keeps none). Collective over `comm` (all-gathers of a
  /// few words): a parameter that holds one rank's part of a split tensor (an MoE's
  /// experts), or ranks that hold different TP ranks' parts of a parameter (a group across the TP
  /// group), is an InvalidArgument on every rank (verify_not_rank_local,
  /// verify_same_tensor_parallel_parts); parameters of other shapes or values on some rank are a
  /// MismatchError on every rank (verify_same_parameters, verify_same_values: a digest word).
  AllReduceGradientSync(std::shared_ptr<Communicator> comm, std::vector<torch::Tensor> params);
  std::shared_ptr<void> skip_sync() override { return nullptr; }
  void finish_sync() override;
  /// The failures ride average_gradients' first all-reduce: none is added.
  void finish_sync_unless_failed(const std::exception_ptr& failed) override;
  double comm_seconds() const override { return comm_seconds_; }

 private:
  std::shared_ptr<Communicator> comm_;
  std::vector<torch::Tensor> params_;
  double comm_seconds_ = 0.0;
};

/// A GradientSync that never communicates: the gradients on each rank are already those of the
/// whole global batch (a pipeline without data parallelism: every rank holds other parameters).
class LocalGradientSync : public GradientSync {
 public:
  std::shared_ptr<void> skip_sync() override { return nullptr; }
  void finish_sync() override {}
  double comm_seconds() const override { return 0.0; }
};

}  // namespace cohort
