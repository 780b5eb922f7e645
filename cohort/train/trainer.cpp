#include "cohort/train/trainer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <limits>
#include <string>

#include "cohort/comm/communicator.h"
#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/train/dcp_checkpoint.h"
#include "cohort/train/progress.h"
#include "cohort/train/rng_state.h"
#include "cohort/train/sample_agreement.h"

namespace cohort {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::shared_ptr<GradNorm> default_norm(const TrainingPlan& plan, std::shared_ptr<GradNorm> norm,
                                       const TrainerOptions& config) {
  if (norm) {
    if (config.determinism == Determinism::WorldSizeInvariant) {
      throw InvalidArgument("Trainer on rank " + std::to_string(plan.process_group()->rank()) +
                            ": a GradNorm of one's own with determinism WorldSizeInvariant "
                            "(the norm is measured in the canonical order)");
    }
    return norm;
  }
  // A pipeline's or a mesh's layout brings its own.
  if (plan.layout().norm()) return plan.layout().norm();
  if (plan.optimizer().sharded_gradients()) {
    return std::make_shared<ShardedGradNorm>(plan.process_group());
  }
  return std::make_shared<ReplicatedGradNorm>();
}

}  // namespace

Trainer::Trainer(TrainingPlan plan, LossFn loss_fn, TrainerOptions config,
                 std::shared_ptr<GradNorm> norm)
    : plan_(std::move(plan)),
      comm_(*plan_.process_group()),
      model_(plan_.model()),
      optimizer_(plan_.optimizer()),
      sync_(plan_.sync()),
      loss_fn_(std::move(loss_fn)),
      config_(std::move(config)),
      norm_(default_norm(plan_, std::move(norm), config_)),
      layout_(plan_.layout()),
      metrics_(config_.metrics_path, comm_.rank() == 0 && plan_.layout().reports(),
               config_.metrics_strict) {
  if (!model_) throw InvalidArgument("Trainer: model is null");
  if (config_.accumulation_steps < 1) {
    throw InvalidArgument("Trainer: accumulation_steps must be at least 1, got " +
                          std::to_string(config_.accumulation_steps));
  }
  if (config_.max_grad_norm < 0) throw InvalidArgument("Trainer: negative max_grad_norm");
  layout_.check(loss_fn_, config_.accumulation_steps, comm_.rank());
  layout_.set_non_finite_loss_seeds_nan(config_.check_for_nan_in_loss_and_grad);
  check_determinism();
  // Each tensor once: LibTorch's parameters() lists a tied weight under
  // each of its names, which the norm would count and clipping scale twice.
  params_ = unique_tensors(model_->parameters());
  // The schedule scales each group's rate as it is now (PyTorch's LambdaLR
  // records the same); checkpoints keep them, so that a resume, whose
  // optimizer state holds the last scheduled rates, does not compound.
  initial_lrs_ = optimizer_.lrs();
  if (config_.schedule.base_lr) {
    for (size_t i = 1; i < initial_lrs_.size(); ++i) {
      if (initial_lrs_[i] == initial_lrs_[0]) continue;
      throw InvalidArgument("Trainer on rank " + std::to_string(comm_.rank()) +
                            ": LrSchedule::base_lr " + std::to_string(*config_.schedule.base_lr) +
                            " would give every parameter group that rate, but group 0 has lr " +
                            std::to_string(initial_lrs_[0]) + " and group " + std::to_string(i) +
                            " has " + std::to_string(initial_lrs_[i]) +
                            "; leave base_lr unset to scale each group's own rate");
    }
  }
  if (!config_.checkpoint_dir.empty()) {
    // Every rank holds the same layout, so every rank refuses.
    const auto why = layout_.cannot_checkpoint();
    if (!why.empty()) {
      throw InvalidArgument("Trainer on rank " + std::to_string(comm_.rank()) +
                            ": checkpoint_dir with " + plan_.mode() + ": " + why);
    }
    checkpoints_.emplace(config_.checkpoint_dir, config_.keep_last,
                         dcp_folder_check(config_.checkpoint_dir));
  }
}

Trainer::Trainer(TrainingPlan plan, TrainerOptions config, std::shared_ptr<GradNorm> norm)
    : Trainer(std::move(plan), LossFn{}, std::move(config), std::move(norm)) {}

// A step's micro-batches as words: how many came, accumulation_steps, the
// first micro-batch whose size differs from micro-batch 0's (-1: none),
// micro-batch 0's size and that one's.
static std::vector<int64_t> micro_batch_words(
    const std::vector<torch::data::Example<>>& micro_batches, int64_t accumulation_steps) {
  const auto k = static_cast<int64_t>(micro_batches.size());
  std::vector<int64_t> w{k, accumulation_steps, -1, k ? micro_batches[0].data.size(0) : 0, 0};
  for (int64_t i = 1; i < k; ++i) {
    const int64_t size = micro_batches[static_cast<size_t>(i)].data.size(0);
    if (size == w[3]) continue;
    w[2] = i;
    w[4] = size;
    break;
  }
  return w;
}

// What is wrong with rank `r`'s micro-batch words, or empty.
static std::string micro_batch_fault(int r, const int64_t* w) {
  const std::string rank = "rank " + std::to_string(r);
  if (w[0] != w[1]) {
    return rank + " got " + std::to_string(w[0]) + " micro-batches, accumulation_steps is " +
           std::to_string(w[1]);
  }
  // The mean of no samples is NaN, which the sync would spread to every
  // rank's gradients (a weight of 0 keeps NaN).
  if (w[2] < 0 && w[3] == 0) return rank + " passed micro-batches of 0 samples";
  if (w[2] < 0) return "";
  return rank + "'s micro-batches have unequal sizes (micro-batch " + std::to_string(w[2]) +
         " has " + std::to_string(w[4]) + " samples, micro-batch 0 has " + std::to_string(w[3]) +
         ")";
}

double Trainer::agree_on_micro_batches(const std::vector<torch::data::Example<>>& micro_batches) {
  // Refused on every rank, or a rank whose batch split unequally would fail
  // alone while its peers wait in the step's collectives until their
  // timeout. No collective runs before the forward to fold this into, so
  // it costs one all-gather of 5 words per step (none alone).
  const auto mine = micro_batch_words(micro_batches, config_.accumulation_steps);
  const RankWords all = comm_.size() > 1 ? gather_words(comm_, mine) : RankWords(mine, 1);
  std::string faults;
  for (int r = 0; r < all.ranks(); ++r) {
    const std::string fault = micro_batch_fault(r, all.of(r));
    if (!fault.empty()) faults += (faults.empty() ? "" : "; ") + fault;
  }
  // Each rank's count fits its own setting above; ranks set differently
  // would weight their micro-batches unlike (1/2 against 1/3) while the sync
  // averages their gradients as equals.
  const auto steps = all.values([](const int64_t* w) { return std::to_string(w[1]); });
  if (!all_same(steps)) {
    faults += (faults.empty() ? "" : "; ") +
              ("ranks disagree on accumulation_steps (" + name_groups(steps) + ")");
  }
  if (faults.empty()) return rank_weight(all);
  std::string sizes;
  for (const auto& b : micro_batches) {
    sizes += (sizes.empty() ? "" : ", ") + std::to_string(b.data.size(0));
  }
  // ReplicaLayout weights each micro-batch's mean loss alike (1/k), a
  // pipeline the samples (it concatenates and re-splits them): with unequal
  // sizes within a rank the two would train differently, neither as one
  // batch would. Across ranks the weight (rank_weight) evens them out.
  throw InvalidArgument("Trainer::train_step on rank " + std::to_string(comm_.rank()) + " of " +
                        std::to_string(comm_.size()) + ": " + faults +
                        "; every rank must have the same accumulation_steps and pass that many "
                        "micro-batches, all of one size of at least 1 sample (the size may differ "
                        "between ranks; this rank's sizes: [" +
                        sizes + "])");
}

// This rank's weight: n·W / T, n its samples, T all W ranks' together.
// The sync averages the replicas as equals, so each replica's mean loss
// times its n·D / N (D replicas, N samples; each replica counted on its
// ranks_per_sample ranks in W and T alike, which cancels) weights every
// sample by 1/N in the average: the mean loss over the N samples, as one
// process on the concatenated batch, in every layout (the reductions are
// linear and do not depend on the batch). With one size everywhere it is
// exactly 1. Per leaf (WorldSizeInvariant), n·W is a leaf's samples times
// the leaf count, the same at every world size.
double Trainer::rank_weight(const RankWords& all) const {
  int64_t total = 0;
  for (int r = 0; r < all.ranks(); ++r) total += all.of(r)[0] * all.of(r)[3];
  const int64_t* mine = all.of(all.ranks() > 1 ? comm_.rank() : 0);
  return static_cast<double>(mine[0] * mine[3] * all.ranks()) / static_cast<double>(total);
}

StepMetrics Trainer::train_step(const std::vector<torch::data::Example<>>& micro_batches) {
  const double weight = agree_on_micro_batches(micro_batches);
  Tracer* const tracer = active(comm_.tracer());
  TraceSpan step_span(tracer, "train step", "train");
  step_span.arg(TraceArg::num("step", static_cast<double>(position_.step)));
  const auto start = std::chrono::steady_clock::now();
  const double comm_before = comm_seconds();
  const uint64_t bytes_before = bytes_sent();
  const auto dims_before = dimension_bytes();
  model_->train();
  optimizer_.zero_grad();
  // Tensor parallelism's collectives run inside the forwards and backwards
  // only: the sync's and the norm's TP all-reduces come after.
  const auto tp_before = tp_wait_seconds();
  double loss = 0;
  std::exception_ptr failed;
  try {
    loss = layout_.step(micro_batches, loss_fn_, tracer, weight);
  } catch (...) {
    // The other replicas would wait in the sync for this rank's gradients.
    if (!layout_.sync_hears_failures()) throw;
    failed = std::current_exception();
  }
  const auto tp_after = tp_wait_seconds();
  int64_t samples = 0;
  for (const auto& b : micro_batches) samples += b.data.size(0);
  {
    TraceSpan span(tracer, "finish sync", "train");
    // Throws on every rank when some rank's step failed, before any
    // optimizer step.
    if (layout_.sync_hears_failures()) {
      sync_.finish_sync_unless_failed(failed);
    } else {
      sync_.finish_sync();
    }
  }

  StepMetrics m;
  // The averaged gradients: the model's .grad, or where an optimizer that
  // averages them itself put them (its shard, for ZeRO).
  if (const auto& clip = plan_.canonical_clip()) {
    // ZeRO's and FSDP's canonical norm; without clipping, only measured.
    const double max_norm = config_.max_grad_norm;
    m.grad_norm = clip(max_norm > 0 ? max_norm : std::numeric_limits<double>::infinity());
    m.clipped = max_norm > 0 && max_norm / (m.grad_norm + 1e-6) < 1.0;
  } else {
    const auto grads = optimizer_.gradients(params_);
    m.grad_norm = norm_->global_norm(grads);
    if (config_.max_grad_norm > 0) {
      m.clipped = clip_grad_norm(grads, m.grad_norm, config_.max_grad_norm);
    }
  }
  // Every rank holds the same norm (of replicated gradients, or summed over the shards), so
  // every rank decides alike, before the step changes the rates, the parameters or the state.
  // A local NaN or Inf gradient made it non-finite through the averaging, as did a replica's
  // non-finite loss (the layout seeds its backward with NaN): no other collective is needed.
  if (config_.check_for_nan_in_loss_and_grad && !std::isfinite(m.grad_norm)) {
    throw_non_finite(loss, m.grad_norm);
  }
  const auto lrs = scheduled_lrs(position_.step);
  m.lr = lrs.empty() ? 0.0 : lrs[0];
  // An async checkpoint's staging copy reads what the step changes.
  if (pending_) pending_->save.wait_staged();
  optimizer_.set_lrs(lrs);
  std::exception_ptr step_failed;
  {
    TraceSpan span(tracer, "optimizer", "train");
    try {
      optimizer_.step();
    } catch (...) {
      // The others would wait for this rank in the loss all-reduce below.
      if (!optimizer_.local_step()) throw;
      step_failed = std::current_exception();
    }
  }
  ++position_.step;

  m.comm_bytes = static_cast<int64_t>(bytes_sent() - bytes_before);
  const auto dims_after = dimension_bytes();
  for (size_t i = 0; i < dims_after.size(); ++i) {
    m.comm_bytes_by_dimension[layout_.dimensions()[i].first] =
        static_cast<int64_t>(dims_after[i] - dims_before[i]);
  }
  // Weighted as the gradients: the mean loss over every rank's samples.
  auto totals = torch::tensor(
      {loss * weight, static_cast<double>(samples), step_failed ? 1.0 : 0.0}, torch::kFloat64);
  comm_.all_reduce(totals, {ReduceOp::Sum}).wait();
  if (totals[2].item<double>() > 0) throw_failed_optimizer_step(step_failed);
  // Every rank of a pipeline (and of a mesh's TP group) reports its
  // replica's loss and samples.
  const int copies = layout_.ranks_per_sample();
  m.step = position_.step;
  m.epoch = position_.epoch;
  m.loss = totals[0].item<double>() / comm_.size();
  m.samples = static_cast<int64_t>(totals[1].item<double>()) / copies;
  position_.global_batch = m.samples;
  m.step_seconds = seconds_since(start);
  m.samples_per_s = m.step_seconds > 0 ? static_cast<double>(m.samples) / m.step_seconds : 0.0;
  m.comm_seconds = comm_seconds() - comm_before;
  if (tp_after) m.tp_comm_seconds = *tp_after - *tp_before;
  return m;
}

void Trainer::throw_failed_optimizer_step(const std::exception_ptr& failed) {
  std::string mine;
  if (failed) {
    try {
      std::rethrow_exception(failed);
    } catch (const std::exception& e) {
      mine = e.what();
    } catch (...) {
      mine = "an exception that is no std::exception";
    }
  }
  const auto texts = gather_texts(comm_, mine);
  std::vector<char> flags;
  std::string what;
  for (const auto& t : texts) {
    flags.push_back(!t.empty());
    if (!t.empty()) what += (what.empty() ? "" : "; ") + t;
  }
  const std::string text =
      "Trainer::train_step on rank " + std::to_string(comm_.rank()) + " of group " + comm_.name() +
      ": the optimizer step threw on " + flagged_ranks(flags) + ": " + what +
      "; the other ranks took theirs, so the replicas may now differ: resume from the last "
      "checkpoint";
  if (!failed) throw Error(text);
  try {
    std::rethrow_exception(failed);
  } catch (...) {
    std::throw_with_nested(Error(text));
  }
}

static std::string non_finite_text(double x) {
  if (std::isnan(x)) return "nan";
  return x > 0 ? "inf" : "-inf";
}

void Trainer::throw_non_finite(double loss, double norm) {
  // The failing path only: one gather of the ranks' loss texts, to name them.
  const auto texts = gather_texts(comm_, std::isfinite(loss) ? "" : non_finite_text(loss));
  std::vector<char> flags;
  std::string values;
  for (const auto& t : texts) {
    flags.push_back(!t.empty());
    if (!t.empty()) values += (values.empty() ? "" : ", ") + t;
  }
  const int64_t step = position_.step + 1;
  std::string text = "Trainer::train_step on rank " + std::to_string(comm_.rank()) + " of group " +
                     comm_.name() + ": step " + std::to_string(step) + " has ";
  if (!values.empty()) {
    text += "a non-finite loss on " + flagged_ranks(flags) + " (" + values +
            ") and gradients whose global norm is " + non_finite_text(norm);
  } else {
    text += "non-finite gradients (global norm " + non_finite_text(norm) +
            ") while every rank's loss is finite: some rank's gradients held a NaN or Inf "
            "before averaging (a hook, an overflow in backward, an input the loss ignores), "
            "which the averaging spreads to every rank, so it cannot name the rank";
  }
  throw NonFiniteError(text +
                       "; no rank took the optimizer step: every rank's parameters and "
                       "optimizer state are those after step " +
                       std::to_string(step - 1) +
                       " (TrainerOptions::check_for_nan_in_loss_and_grad)");
}

std::vector<double> Trainer::scheduled_lrs(int64_t step) const {
  const LrSchedule& schedule = config_.schedule;
  const double peak = schedule.base_lr.value_or(initial_lrs_.empty() ? 0.0 : initial_lrs_[0]);
  const double rate = lr_at(schedule, step, peak);
  std::vector<double> out;
  for (const double initial : initial_lrs_) {
    if (schedule.base_lr || initial == peak) {
      out.push_back(rate);
    } else if (peak != 0) {
      out.push_back(initial * (rate / peak));
    } else {
      // A first group at rate 0: the others follow the schedule's shape.
      LrSchedule shape = schedule;
      shape.min_lr = 0;
      out.push_back(initial * lr_at(shape, step, 1.0));
    }
  }
  return out;
}

std::optional<double> Trainer::tp_wait_seconds() const {
  for (const auto& [name, groups] : layout_.dimensions()) {
    if (name != "tp") continue;
    double seconds = 0;
    for (const auto& c : groups) seconds += c->stats().total().seconds_waiting;
    return seconds;
  }
  return std::nullopt;
}

uint64_t Trainer::bytes_sent() const {
  uint64_t bytes = 0;
  // bytes_sent_ever: a reset_stats() in the step (the model's forward, a
  // hook) must not wrap the step's difference.
  for (const auto& c : plan_.traffic()) bytes += c->stats().bytes_sent_ever;
  return bytes;
}

std::vector<uint64_t> Trainer::dimension_bytes() const {
  std::vector<uint64_t> out;
  for (const auto& [name, groups] : layout_.dimensions()) {
    uint64_t bytes = 0;
    for (const auto& c : groups) bytes += c->stats().bytes_sent_ever;
    out.push_back(bytes);
  }
  return out;
}

double Trainer::comm_seconds() const {
  // Gradients are reduced by the sync (DDP) or by the optimizer (fused,
  // ZeRO): the two never both measure the same reduction. A pipeline adds
  // its send and receive actions.
  return sync_.comm_seconds() + optimizer_.comm_seconds() + layout_.comm_seconds();
}

std::vector<StepMetrics> Trainer::fit(DataSource& data, const FitCallbacks& callbacks) {
  const int64_t k = config_.accumulation_steps;
  start_epoch(data);
  if (resumed_) continue_epoch_order(data);
  const int64_t g = data.global_micro_batch();
  if (position_.step == 0 && last_checkpoint_step_ < 0) metrics_.keep_until(-1);
  end_epoch_past_data(data, callbacks);

  // Epochs may differ in length (a source that grows, or a resume with
  // another dataset): the loop ends on the epochs, or on max_steps when set.
  // The total is only what the progress line expects: this epoch's steps
  // left, and every later epoch as long as this one.
  const int64_t steps_per_epoch = data.num_batches() / k;
  int64_t total = position_.step + (data.num_batches() - position_.batch) / k +
                  std::max<int64_t>(config_.epochs - position_.epoch - 1, 0) * steps_per_epoch;
  if (config_.max_steps > 0) total = std::min(total, config_.max_steps);
  Progress progress(config_.progress && comm_.rank() == 0 && layout_.reports(), position_.step,
                    total, config_.log_every);
  std::vector<StepMetrics> out;
  auto epoch_start = std::chrono::steady_clock::now();
  while (more_to_train()) {
    std::vector<torch::data::Example<>> batches;
    for (int64_t i = 0; i < k; ++i) batches.push_back(data.batch(position_.batch + i));
    position_.batch += k;
    position_.epoch_samples = g > 0 ? position_.batch * g : -1;
    position_.epoch_batches = data.num_batches();
    position_.data_order = data.order_settings();
    position_.data_samples = agreed_data_.samples;
    position_.data_parallel = comm_.size() / layout_.ranks_per_sample();
    StepMetrics m = train_step(batches);
    metrics_.append(to_json(m));
    progress.update(m);
    out.push_back(m);
    if (callbacks.on_step) callbacks.on_step(m);

    // The epoch is over when the next step has too few micro-batches left.
    if (position_.batch + k > data.num_batches()) {
      progress.finish();
      end_epoch(data, callbacks, seconds_since(epoch_start));
      epoch_start = std::chrono::steady_clock::now();
    }
    if (config_.checkpoint_every > 0 && position_.step % config_.checkpoint_every == 0) {
      save_checkpoint();
    }
  }
  progress.finish();
  if (last_checkpoint_step_ != position_.step) save_checkpoint();
  finish_checkpoint();
  return out;
}

bool Trainer::more_to_train() const {
  return position_.epoch < config_.epochs &&
         (config_.max_steps <= 0 || position_.step < config_.max_steps);
}

void Trainer::end_epoch_past_data(DataSource& data, const FitCallbacks& callbacks) {
  // A resume with less data (another dataset) can find the epoch already
  // past its new end: it ends there, as a sampler fast-forwarded past its
  // end yields nothing (torchdata's StatefulDistributedSampler). Every rank
  // agreed on the epoch's micro-batches and holds the checkpoint's position,
  // so every rank ends it.
  const int64_t k = config_.accumulation_steps;
  if (position_.batch == 0 || position_.batch + k <= data.num_batches() || !more_to_train()) {
    return;
  }
  if (comm_.rank() == 0) {
    std::fprintf(stderr,
                 "cohort: epoch %lld continues at micro-batch %lld but now has %lld (%lld a "
                 "step): the epoch ends there\n",
                 static_cast<long long>(position_.epoch), static_cast<long long>(position_.batch),
                 static_cast<long long>(data.num_batches()), static_cast<long long>(k));
  }
  end_epoch(data, callbacks, 0.0);
}

void Trainer::end_epoch(DataSource& data, const FitCallbacks& callbacks, double seconds) {
  if (callbacks.on_epoch_end) callbacks.on_epoch_end({position_.epoch, position_.step, seconds});
  ++position_.epoch;
  position_.batch = 0;
  position_.epoch_samples = 0;
  if (position_.epoch < config_.epochs) start_epoch(data);
}

void Trainer::start_epoch(DataSource& data) {
  data.set_epoch(position_.epoch);
  agree_on_epoch(data);
  // Agreed above: every rank has as many micro-batches, so every rank throws.
  if (data.num_batches() < config_.accumulation_steps) {
    throw InvalidArgument("Trainer::fit on rank " + std::to_string(comm_.rank()) + ": epoch " +
                          std::to_string(position_.epoch) + " has " +
                          std::to_string(data.num_batches()) +
                          " micro-batches, fewer than accumulation_steps " +
                          std::to_string(config_.accumulation_steps));
  }
}

void Trainer::agree_on_epoch(DataSource& data) {
  // Every rank steps together: a rank with fewer micro-batches, another
  // accumulation or another step limit would leave the loop while the
  // others wait in their next step's collectives until the timeout.
  const std::string mine =
      "epoch " + std::to_string(position_.epoch) + ": " + std::to_string(data.num_batches()) +
      " micro-batches (global " + std::to_string(data.global_micro_batch()) + "), accumulation " +
      std::to_string(config_.accumulation_steps) + ", epochs " + std::to_string(config_.epochs) +
      ", max_steps " + std::to_string(config_.max_steps);
  const std::string who = "Trainer::fit on rank " + std::to_string(comm_.rank()) + ": ";
  // The source's order and share of the data ride on the same all-gather:
  // a source made with the world's rank 0 on every rank, or with another
  // seed or dataset on one, would pass everything else, its replicas
  // training on some samples twice and others never.
  const DataShard shard = data.shard();
  const std::string order = data.order_settings();
  auto words = text_words(mine);
  const size_t width = words.size();
  words.push_back(shard.rank);
  words.push_back(shard.world);
  words.push_back(shard.samples);
  for (const int64_t w : order_words(order)) words.push_back(w);
  const RankWords all = comm_.size() > 1 ? gather_words(comm_, words) : RankWords(words, 1);
  std::vector<int64_t> texts;
  std::vector<DataShard> shards;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t* w = all.of(r);
    texts.insert(texts.end(), w, w + width);
    shards.push_back({static_cast<int>(w[width]), static_cast<int>(w[width + 1]), w[width + 2]});
  }
  check_same_text(RankWords(texts, all.ranks()), who,
                  "the data source's micro-batches or the training length");
  agreed_data_.order = check_data_order(comm_, all, width + 3, order, who);
  agreed_data_.samples = -1;
  for (const auto& s : shards) agreed_data_.samples = std::max(agreed_data_.samples, s.samples);
  std::string shard_fault;
  try {
    check_data_shards(shards, layout_.ranks_per_sample(), who);
  } catch (const InvalidArgument& e) {
    shard_fault = e.what();
  }
  // A pipeline trains stage 0's rank's inputs against the last stage's
  // rank's targets, and a TP group's ranks each compute part of one
  // layer's output from their own inputs: their sources must deal the same
  // samples, or the step silently pairs one rank's data with another's.
  agree_on_samples(comm_, layout_, data, position_.epoch);
  // After the samples' check, which names the ranks that drew other samples
  // than their pipeline or TP peers; every rank gathered the same shards.
  if (!shard_fault.empty()) throw InvalidArgument(shard_fault);
}

int64_t Trainer::global_batch_of(DataSource& data) {
  const int64_t k = config_.accumulation_steps;
  if (data.global_micro_batch() > 0) return data.global_micro_batch() * k;
  // No global order: the ranks' first micro-batches of the epoch, as a step
  // would count them. A read outside the training order: its draws from the
  // default generators are undone, as the uninterrupted run never made it.
  double mine = 0;
  if (data.num_batches() > 0) {
    DefaultRngStatesKept kept;
    mine = static_cast<double>(data.batch(0).data.size(0));
  }
  auto total = torch::tensor({mine}, torch::kFloat64);
  comm_.all_reduce(total, {ReduceOp::Sum}).wait();
  return static_cast<int64_t>(total.item<double>()) / layout_.ranks_per_sample() * k;
}

void Trainer::continue_epoch_order(DataSource& data) {
  // The checkpoint's micro-batch index counts the micro-batches of the job
  // that wrote it; another world size, micro-batch or accumulation cuts the
  // epoch into others. The samples of the epoch's global order done so far
  // say where this job's cut continues.
  const bool resized = resized_;
  resumed_ = resized_ = false;
  const int64_t g = data.global_micro_batch();
  // Another global batch cuts every epoch into another number of steps,
  // which the checkpoint's step count no longer matches (fit() could end
  // before an epoch it never trained), and changes what a step means.
  // Every rank resumed from the same checkpoint: all or none ask.
  const int64_t batch = position_.global_batch > 0 ? global_batch_of(data) : 0;
  if (batch > 0 && batch != position_.global_batch) {
    throw ConfigError("Trainer::fit on rank " + std::to_string(comm_.rank()) +
                      ": resumed from a checkpoint (step " + std::to_string(position_.step) +
                      ") whose global batch is " + std::to_string(position_.global_batch) +
                      " samples, but this job's is " + std::to_string(batch) + " (" +
                      std::to_string(config_.accumulation_steps) +
                      " accumulation steps x a global micro-batch of " +
                      std::to_string(batch / config_.accumulation_steps) +
                      "); keep micro-batch x accumulation_steps x data-parallel size the same");
  }
  if (position_.batch == 0 && position_.epoch_samples <= 0) return;
  const std::string where = "Trainer::fit on rank " + std::to_string(comm_.rank()) +
                            ": resumed in the middle of epoch " + std::to_string(position_.epoch);
  // The position counts the samples of the epoch's order under the
  // checkpoint's settings; under others (another seed) it names other
  // samples. Decided by what every rank holds alike: the checkpoint's
  // record and the settings the ranks agreed on.
  const auto agreed = agreed_data_.order;
  if (!position_.data_order.empty() && agreed && *agreed != fnv1a(position_.data_order)) {
    const std::string order = data.order_settings();
    throw ConfigError(where + ", whose samples the checkpoint's data source dealt by \"" +
                      position_.data_order + "\", but this job's " +
                      (order.empty() ? "sources deal by other settings (not said on this rank)"
                                     : "deals by \"" + order + "\"") +
                      ": the checkpoint's position counts the samples of the old order, so the "
                      "rest of the epoch would train on some samples twice and others never; "
                      "resume with the checkpoint's order settings (or from a checkpoint at an "
                      "epoch's start)");
  }
  if (g > 0 && position_.epoch_samples >= 0) {
    if (!data.resumes_over_another_dataset()) refuse_another_dataset(where);
    if (position_.epoch_samples % g != 0) {
      throw ConfigError(where + " after " + std::to_string(position_.epoch_samples) +
                        " samples, which is not a whole number of this job's global "
                        "micro-batches of " +
                        std::to_string(g) +
                        " (micro-batch x world); keep the global batch the same");
    }
    position_.batch = position_.epoch_samples / g;
    return;
  }
  // No global order to count in (or a checkpoint older than its record):
  // the index carries over to the same cut of the epoch only.
  if (resized) {
    throw ConfigError(where +
                      " at a new world size, but the data source (or the checkpoint's) has no "
                      "global sample order (DataSource::global_micro_batch)");
  }
  // At the same world size another layout (dp 2 x pp 2 -> pp 4) deals the
  // epoch in other shares, which the index counts no longer.
  const int64_t dp = comm_.size() / layout_.ranks_per_sample();
  if (position_.data_parallel > 0 && position_.data_parallel != dp) {
    throw ConfigError(where + " at data-parallel size " + std::to_string(dp) +
                      ", but the job that wrote the checkpoint trained at data-parallel size " +
                      std::to_string(position_.data_parallel) +
                      ": without a global sample order (DataSource::global_micro_batch) its "
                      "micro-batch index counts micro-batches of that many shares of the epoch, "
                      "so the rest of the epoch would train some samples twice and others never; "
                      "resume at data-parallel size " +
                      std::to_string(position_.data_parallel) +
                      " (or from a checkpoint at an epoch's start)");
  }
  if (position_.epoch_batches > 0 && position_.epoch_batches != data.num_batches()) {
    throw ConfigError(where + ": the data source has " + std::to_string(data.num_batches()) +
                      " micro-batches an epoch, the job that wrote the checkpoint had " +
                      std::to_string(position_.epoch_batches) +
                      "; without a global sample order (DataSource::global_micro_batch) its "
                      "position does not carry over to micro-batches of another size or to "
                      "another dataset");
  }
  // Another dataset with as many micro-batches an epoch (one sample more).
  refuse_another_dataset(where);
}

void Trainer::refuse_another_dataset(const std::string& where) const {
  const int64_t samples = agreed_data_.samples;
  if (position_.data_samples >= 0 && samples >= 0 && samples != position_.data_samples) {
    throw ConfigError(where + ": the job that wrote the checkpoint dealt from " +
                      std::to_string(position_.data_samples) +
                      " samples, this job's data source from " + std::to_string(samples) +
                      " samples; its position counts the samples of the old dataset's order "
                      "(the source has no global sample order, DataSource::global_micro_batch, "
                      "or does not resume over another dataset, "
                      "DataSource::resumes_over_another_dataset), which does not carry over to "
                      "another dataset");
  }
}

void Trainer::check_determinism() const {
  const std::string where = "Trainer on rank " + std::to_string(comm_.rank()) + ": ";
  const bool wanted = config_.determinism == Determinism::WorldSizeInvariant;
  const bool built = plan_.determinism() == Determinism::WorldSizeInvariant;
  if (wanted && !built) {
    const bool can = plan_.can_be_world_size_invariant();
    throw InvalidArgument(
        where + "determinism WorldSizeInvariant, but " + plan_.mode() +
        (can ? " was built without it (DDPOptions, ZeroOptions or FullyShardOptions::determinism "
               "and leaves)"
             : " cannot honour it (only DDP, ZeRO over DDP and FSDP sum the leaves in the "
               "canonical tree)"));
  }
  if (!wanted && built) {
    throw InvalidArgument(where + "the " + plan_.mode() +
                          " was built with determinism WorldSizeInvariant; set "
                          "TrainerOptions::determinism and leaves to the same");
  }
  if (!wanted) return;
  if (config_.leaves != plan_.leaves()) {
    throw InvalidArgument(where + "TrainerOptions::leaves " + std::to_string(config_.leaves) +
                          ", but the " + plan_.mode() + " was built with " +
                          std::to_string(plan_.leaves()));
  }
  if (config_.accumulation_steps != plan_.local_leaves()) {
    throw InvalidArgument(where + "accumulation_steps must be this rank's leaves per step, " +
                          std::to_string(plan_.local_leaves()) + " (" +
                          std::to_string(config_.leaves) + " leaves over " +
                          std::to_string(comm_.size()) + " ranks), got " +
                          std::to_string(config_.accumulation_steps));
  }
}

void Trainer::log_eval(const nlohmann::json& fields) {
  nlohmann::json line = {{"kind", "eval"}, {"step", position_.step}, {"epoch", position_.epoch}};
  for (auto it = fields.begin(); it != fields.end(); ++it) line[it.key()] = it.value();
  metrics_.append(line);
}

}  // namespace cohort
