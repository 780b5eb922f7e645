// defines: TrainerOptions and Trainer, the data-parallel training loop:
// micro-batches with gradient accumulation, clipping by global norm,
// learning-rate schedule, metrics, progress, and checkpoints with resume.
//
// One optimizer step of Trainer::train_step, on every rank:
//   0. one all-gather of 5 words: every rank passed accumulation_steps
//      micro-batches of one nonzero size, or every rank refuses the step;
//      it gives each rank its weight w = n·W / T (n its samples, T all W
//      ranks'), 1 when every rank has as many;
//   1. zero the gradients;
//   2. for each of the k micro-batches: loss = loss_fn(batch); (loss / k · w)
//      .backward(). All but the last run under GradientSync::skip_sync(), so
//      gradients accumulate locally and only the last backward communicates;
//   3. GradientSync::finish_sync(): every rank now holds the gradient of the
//      mean loss over the whole global batch (k micro-batches x all ranks),
//      or, for an optimizer that averages inside its step (fused, ZeRO-2),
//      TrainerOptimizer::gradients() averages them (ZeRO-2: into its shard).
//      A layout whose step sends nothing over the sync's groups (a
//      pipeline's) hands a step that threw to finish_sync_unless_failed,
//      whose first all-reduce tells every rank: all throw here;
//   4. the global gradient norm via GradNorm (local for replicated
//      gradients, an all-reduce of squared partial norms for sharded ones),
//      then clipping when it exceeds max_grad_norm; a non-finite norm ends
//      the step here on every rank (check_for_nan_in_loss_and_grad);
//   5. each group's lr = its initial lr scaled by the schedule at the step
//      (lr_schedule.h); optimizer step;
//   6. one small all-reduce for the loss averaged over all samples; it also
//      carries whether a rank's optimizer step threw (a LibTorch
//      optimizer's, which sends nothing): then every rank throws.
// Steps 1-5 are the same arithmetic on every rank, so the replicas stay
// identical without broadcasting weights.
//
// What it trains with comes as a TrainingPlan (cohort/plan/training_plan.h,
// made by TrainerWiring's factories, cohort/wiring): the Trainer knows no
// mode. How the model is laid out over the ranks (replicas, a pipeline, a
// TP x PP x DP mesh) is the plan's TrainerLayout, which runs step 2
// (with a pipeline: one PipelineRuntime step over the k micro-batches, k
// being the schedule's m) and gives the norm of step 4 and the copies of
// step 6. How each plan clips and checkpoints (dcp, resharded at any
// world size but for a compressor's per-rank state): cohort/train/README.md.
// The DDP and optimizers behind the plan must outlive the trainer. It has
// no global state: several trainers (ranks as threads) coexist.
#pragma once

#include <torch/data/example.h>
#include <torch/nn/module.h>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/dcp/async_save.h"
#include "cohort/grad_sync/leaf_tree.h"
#include "cohort/plan/grad_norm.h"
#include "cohort/plan/gradient_sync.h"
#include "cohort/plan/trainer_optimizer.h"
#include "cohort/plan/training_plan.h"
#include "cohort/train/checkpoint_dir.h"
#include "cohort/train/data_source.h"
#include "cohort/train/lr_schedule.h"
#include "cohort/train/metrics_log.h"
#include "cohort/train/training_state.h"

namespace cohort {

class RankWords;
class Tracer;

/// What the Trainer does each step and around it; the same on every rank.
struct TrainerOptions {
  /// Micro-batches per optimizer step (gradient accumulation); >= 1.
  int64_t accumulation_steps = 1;
  /// Clip gradients to this global L2 norm; 0 disables clipping.
  double max_grad_norm = 0.0;
  /// Learning rate per step: scales each parameter group's own rate as the
  /// Trainer found it (PyTorch's LambdaLR), or sets every group's peak to
  /// schedule.base_lr when that is set (lr_schedule.h). The default is the
  /// optimizer's rates, unchanged.
  LrSchedule schedule;
  /// fit() runs this many epochs...
  int64_t epochs = 1;
  /// ...or stops at this many optimizer steps when positive.
  int64_t max_steps = 0;
  /// Folder for checkpoints; empty: no checkpoints and no resume. Refused (InvalidArgument on
  /// every rank) where the layout cannot checkpoint: a model of TP layers outside a mesh.
  std::string checkpoint_dir;
  /// Checkpoint every this many steps (0: only at the end of fit()).
  int64_t checkpoint_every = 0;
  /// Sharded state (ZeRO, FSDP, a pipeline's or a mesh's stages) is saved with
  /// dcp::async_save: the staging copy runs during the next step's forward
  /// and backward (the step waits for it before the optimizer step), the
  /// files are written in the background, and the checkpoint is committed
  /// (its folder's .metadata, then rank 0's file) at the next save, at the
  /// end of fit(), at resume() or at Trainer::finish_checkpoint(), where a
  /// failed write throws on every rank. A crash before that leaves the
  /// previous checkpoint the newest. Other state is saved as before
  /// (blocking). A loop of train_step() and save_checkpoint() calls
  /// finish_checkpoint() after its last save: a Trainer destroyed with a
  /// save pending has not committed it (it says so on stderr).
  bool async_checkpoint = false;
  /// Checkpoints kept on disk (older ones are deleted).
  int keep_last = 3;
  /// When checkpoint_dir holds checkpoints but none of them verifies,
  /// resume() throws CheckpointError on every rank (false), or reports them
  /// and starts from step 0 (true). Damaged files are left in place either way.
  bool start_fresh_if_damaged = false;
  /// JSON-lines metrics file written by rank 0 (with TP layers outside a mesh: TP rank 0's);
  /// empty: none.
  std::string metrics_path;
  /// A metrics line that cannot be written (a full disk) throws Error instead
  /// of one warning on stderr. Lines are written whole or not at all either way.
  bool metrics_strict = false;
  /// Progress output on rank 0 (bar on a terminal, log lines otherwise).
  bool progress = true;
  /// Steps between log lines when stdout is not a terminal.
  int64_t log_every = 50;
  /// Determinism::WorldSizeInvariant: training is the same bits at every
  /// world size dividing `leaves` (README, "Determinism"). The wiring's DDP
  /// (alone or with a ZeRO built from it) or FSDP root must have been built
  /// with the same determinism and leaves, and the Trainer with neither when
  /// they were not: InvalidArgument on every rank otherwise, and for every
  /// other wiring (fused, all-reduce, ZeRO without DDP, pipeline, mesh),
  /// which cannot honour it. Each of a step's micro-batches is then one leaf
  /// (accumulation_steps = leaves / world): rank r's micro-batch i must be
  /// leaf r x accumulation_steps + i of the global batch, in train_step and
  /// in a DataSource for fit() (a contiguous slice per rank; not
  /// TensorDataSource's order, which interleaves the ranks). Each backward
  /// is unscaled and reaches the reducer; the norm is measured in the
  /// canonical order (ZeRO, FSDP: their clip_grad_norm; DDP: the same
  /// replicated bits on every rank), and a GradNorm of one's own is refused.
  Determinism determinism = Determinism::Default;
  /// The leaf count of the global batch (WorldSizeInvariant only).
  int64_t leaves = 0;
  /// A NaN or Inf in any rank's loss or gradients ends the step before the optimizer on every
  /// rank: NonFiniteError on each, naming the step and the ranks whose loss was non-finite;
  /// parameters and optimizer state stay as the step before left them (Megatron-LM's
  /// --check-for-nan-in-loss-and-grad). It reads the global gradient norm every step computes,
  /// which a local non-finite gradient makes non-finite on every rank; a replica's non-finite
  /// loss seeds its backward with NaN to get there (README, "Non-finite loss or gradients").
  /// False: the optimizer steps on them, as PyTorch's DDP does.
  bool check_for_nan_in_loss_and_grad = true;
};

/// Trainer::train_step found a non-finite loss or gradient (TrainerOptions::
/// check_for_nan_in_loss_and_grad): thrown on every rank, before any rank's optimizer step.
class NonFiniteError : public Error {
 public:
  using Error::Error;
};

/// Deprecated: the former name of TrainerOptions.
using TrainerConfig [[deprecated("use cohort::TrainerOptions")]] = TrainerOptions;

/// What FitCallbacks::on_epoch_end receives.
struct EpochEnd {
  int64_t epoch = 0;     ///< the epoch that ended (0-based)
  int64_t step = 0;      ///< optimizer steps done
  double seconds = 0.0;  ///< wall time of the epoch's training steps
};

/// Optional callbacks of Trainer::fit(), called on every rank.
struct FitCallbacks {
  /// After every optimizer step (metrics already logged).
  std::function<void(const StepMetrics&)> on_step;
  /// After the last step of an epoch, before the checkpoint of that step:
  /// the place for evaluation (log it with Trainer::log_eval).
  std::function<void(const EpochEnd&)> on_epoch_end;
};

/// The data-parallel training loop (see the file comment): train_step(), fit(), checkpoints and
/// resume. Every call but log_eval() and the accessors is collective: all ranks call it in the same
/// order.
class Trainer {
 public:
  /// plan: the communicator, model, optimizer, gradient sync, layout and state dict, from one
  /// of TrainerWiring's factories (only valid pairings compile);
  /// norm: nullptr means ReplicatedGradNorm, or ShardedGradNorm when the
  /// optimizer's gradients are sharded (TrainerOptimizer::sharded_gradients).
  Trainer(TrainingPlan plan, LossFn loss_fn, TrainerOptions config,
          std::shared_ptr<GradNorm> norm = nullptr);

  /// A trainer that steps a pipeline (TrainerWiring::pipeline): the runtime's loss function,
  /// on the last stage, computes the loss. config.accumulation_steps must be the schedule's
  /// number of micro-batches; norm: nullptr means ShardedGradNorm over the pipeline group.
  Trainer(TrainingPlan plan, TrainerOptions config, std::shared_ptr<GradNorm> norm = nullptr);

  /// A checkpoint still pending (async_checkpoint, not yet committed by
  /// finish_checkpoint()) is not committed here, which would take
  /// collectives: rank 0 says so on stderr, and resume() finds the one before.
  ~Trainer();

  /// Loads the newest checkpoint that verifies from config.checkpoint_dir
  /// (collective). Newer ones that fail (a damaged file, or a damaged part
  /// that a rank meets while loading: a data file of its dcp folder) are
  /// reported on stderr by rank 0 and listed in
  /// skipped_checkpoints(), and every rank falls back to the same older one.
  /// Returns the step resumed at, or nullopt when there is no checkpoint; when
  /// there are some and none verifies, CheckpointError on every rank unless
  /// config.start_fresh_if_damaged.
  ///
  /// Every wiring's model and optimizer state is a distributed checkpoint
  /// (cohort/dcp) under the bare model's names, so a checkpoint resumes
  /// resharded at any world size and into any other wiring where the model
  /// agrees (DDP, all-reduce, ZeRO stage 1 or 2, the fused optimizer, FSDP;
  /// a mesh whose stages are modules: at any tp x pp x dp; a pipeline: with
  /// the same stages, TrainerWiring::pipeline). Rank r takes the RNG state
  /// of the old rank r; a rank the old world did not have starts a
  /// generator seeded with its rank and the step. The model's own random
  /// streams (its modules that are RngStreams, rng_state.h) get the old
  /// rank r's state too, and decide themselves whether it continues. Each optimizer parameter
  /// group takes the schedule's initial rate the checkpoint recorded for its parameters, by
  /// their names, whichever rank held them (ConfigError on every rank, nothing loaded, when
  /// they were not recorded or at different rates). The next fit() continues
  /// the epoch after the samples of its global order already trained
  /// (DataSource::global_micro_batch), whatever the world size, micro-batch
  /// and accumulation_steps; keep the global batch (micro-batch x
  /// accumulation_steps x world) the same.
  /// A stateful gradient compressor's per-rank state (error feedback) is in
  /// the distributed checkpoint too, each rank's under its own names: it
  /// resumes only at the world size that wrote it, and only into a trainer
  /// with such a compressor (a checkpoint without it starts the compressor
  /// afresh): ConfigError on every rank otherwise, with nothing loaded. So
  /// is a checkpoint of an earlier cohort without a dcp folder (the model
  /// and optimizer in rank 0's file, or per-rank shard files).
  std::optional<int64_t> resume();

  /// One optimizer step over `micro_batches` (accumulation_steps of them).
  StepMetrics train_step(const std::vector<torch::data::Example<>>& micro_batches);

  /// Trains from the current position to config.epochs / config.max_steps,
  /// checkpointing every checkpoint_every steps and at the end. Returns the
  /// metrics of the steps it ran. A resumed epoch that the data source now
  /// ends before the checkpoint's position (less data) ends at once
  /// (on_epoch_end), and the next one trains.
  std::vector<StepMetrics> fit(DataSource& data, const FitCallbacks& callbacks = {});

  /// Writes a checkpoint of the current state (collective). The model and
  /// optimizer state and each rank's gradient-sync state go into the folder
  /// "<checkpoint>.dcp" (dcp::save, every rank its own data file; see
  /// dcp_checkpoint.h).
  void save_checkpoint();

  /// Collective: commits the checkpoint that save_checkpoint() left pending
  /// under async_checkpoint (waits for every rank's files, then writes the
  /// folder's .metadata and rank 0's file), or throws the failed write's
  /// error on every rank; nothing when none is pending. fit() commits its
  /// own at its end; a loop of train_step() and save_checkpoint() calls this
  /// after its last save, as PyTorch waits on async_save's future.
  void finish_checkpoint();

  /// Appends {"kind": "eval", "step", "epoch", **fields} to the metrics file.
  void log_eval(const nlohmann::json& fields);

  /// Where training is: steps done, and the epoch and micro-batch to run next.
  const TrainingPosition& position() const { return position_; }
  /// Why each newer checkpoint was skipped by the last resume(), newest first.
  const std::vector<std::string>& skipped_checkpoints() const { return skipped_; }
  /// The configuration it was built with.
  const TrainerOptions& config() const { return config_; }

 private:
  double comm_seconds() const;
  uint64_t bytes_sent() const;
  std::vector<uint64_t> dimension_bytes() const;
  // Seconds blocked in the "tp" dimension's collectives so far; none without one.
  std::optional<double> tp_wait_seconds() const;
  // Each parameter group's rate for optimizer step `step`.
  std::vector<double> scheduled_lrs(int64_t step) const;
  // After the loss all-reduce said some rank's optimizer step threw
  // (`failed` here, or null): gathers the messages, throws on every rank.
  [[noreturn]] void throw_failed_optimizer_step(const std::exception_ptr& failed);
  // After the global norm came out non-finite on every rank: gathers which
  // ranks' losses were, throws NonFiniteError on every rank.
  [[noreturn]] void throw_non_finite(double loss, double norm);
  void check_determinism() const;
  std::pair<int64_t, int64_t> choose_checkpoint(int64_t below, std::string& payload);
  void load_checkpoint(int64_t step, std::string payload);
  // Each of this rank's groups' initial rate as the checkpoint recorded it
  // for its parameters (initial_lrs.h); ConfigError when one cannot be matched.
  std::vector<double> resumed_initial_lrs(const DecodedState& state, const std::string& path);
  std::optional<int64_t> start_fresh(int64_t skipped);
  void check_checkpoint(const CheckpointKind& kind, const std::string& path) const;
  void load_dcp(const std::string& folder, int64_t old_world);
  void check_sync_state(const dcp::Metadata& meta, int64_t old_world,
                        const std::string& folder) const;
  void continue_epoch_order(DataSource& data);
  /// Collective when the source has no global order: this job's samples per
  /// optimizer step over all ranks.
  int64_t global_batch_of(DataSource& data);
  // ConfigError after `where` when the data source deals from another
  // dataset size than the checkpoint's position counts.
  void refuse_another_dataset(const std::string& where) const;
  /// Whether fit() trains on: epochs and max_steps not reached.
  bool more_to_train() const;
  /// Collective: ends the epoch (end_epoch) when the source's micro-batches
  /// after the position make no step (a resume with less data).
  void end_epoch_past_data(DataSource& data, const FitCallbacks& callbacks);
  /// Collective: the epoch's end (on_epoch_end with its `seconds`), then the
  /// next epoch's start when there is one (start_epoch).
  void end_epoch(DataSource& data, const FitCallbacks& callbacks, double seconds);
  /// Collective: sets the data source's epoch to the position's and agrees
  /// on it (agree_on_epoch); throws on every rank when it has fewer
  /// micro-batches than a step takes.
  void start_epoch(DataSource& data);
  /// Collective: throws on every rank unless all have the same micro-batches
  /// this epoch and the same accumulation, epochs and max_steps.
  void agree_on_epoch(DataSource& data);
  /// Collective (one all-gather of 5 words; none alone): throws on every
  /// rank unless each passed accumulation_steps micro-batches of one
  /// nonzero size, naming the ranks that did not; returns rank_weight.
  double agree_on_micro_batches(const std::vector<torch::data::Example<>>& micro_batches);
  /// This rank's loss weight from every rank's micro-batch words, 1 when
  /// every rank has as many samples (trainer.cpp).
  double rank_weight(const RankWords& all) const;
  /// Collective: rank 0 writes its file of `step` (`payload`: rank 0's);
  /// a failed write throws on every rank.
  void write_main_file(int64_t step, const std::string& payload);

  TrainingPlan plan_;
  Communicator& comm_;
  std::shared_ptr<torch::nn::Module> model_;
  std::vector<torch::Tensor> params_;
  TrainerOptimizer& optimizer_;
  // Each of this rank's parameter groups' rate when the Trainer was made
  // (or as the resumed checkpoint recorded it for the group's parameters):
  // what the schedule scales.
  std::vector<double> initial_lrs_;
  GradientSync& sync_;
  LossFn loss_fn_;
  TrainerOptions config_;
  std::shared_ptr<GradNorm> norm_;
  TrainerLayout& layout_;
  std::optional<CheckpointDir> checkpoints_;
  MetricsLog metrics_;
  TrainingPosition position_;
  int64_t last_checkpoint_step_ = -1;
  bool resumed_ = false;  // fit() finds this job's micro-batch in the resumed epoch
  bool resized_ = false;  // ...resumed at another world size
  // What the ranks' sources agreed on at the epoch's start, the same on
  // every rank: the digest of their DataSource::order_settings (none: no
  // source says) and their dataset's size (-1: none says).
  struct AgreedData {
    std::optional<uint64_t> order;
    int64_t samples = -1;
  };
  AgreedData agreed_data_;
  std::vector<std::string> skipped_;
  // The async checkpoint being written: its dcp save, and rank 0's main
  // file, written once the save is committed.
  struct PendingCheckpoint {
    dcp::AsyncSave save;
    int64_t step = -1;
    std::string payload;
  };
  std::optional<PendingCheckpoint> pending_;
};

}  // namespace cohort
