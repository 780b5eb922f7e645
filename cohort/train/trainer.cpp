#include "cohort/train/trainer.h"

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/dcp.h"
#include "cohort/train/dcp_checkpoint.h"
#include "cohort/train/progress.h"
#include "cohort/train/rng_state.h"

namespace cohort {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

std::shared_ptr<GradNorm> default_norm(const TrainerWiring& wiring) {
  // A pipeline's or a mesh's layout brings its own.
  if (wiring.layout().norm()) return wiring.layout().norm();
  if (wiring.optimizer().sharded_gradients()) {
    return std::make_shared<ShardedGradNorm>(wiring.communicator());
  }
  return std::make_shared<ReplicatedGradNorm>();
}

}  // namespace

Trainer::Trainer(TrainerWiring wiring, LossFn loss_fn, TrainerConfig config,
                 std::shared_ptr<GradNorm> norm)
    : wiring_(std::move(wiring)),
      comm_(*wiring_.communicator()),
      model_(wiring_.model()),
      optimizer_(wiring_.optimizer()),
      sync_(wiring_.sync()),
      loss_fn_(std::move(loss_fn)),
      config_(std::move(config)),
      norm_(norm ? std::move(norm) : default_norm(wiring_)),
      layout_(wiring_.layout()),
      metrics_(config_.metrics_path, comm_.rank() == 0, config_.metrics_strict) {
  if (!model_) throw InvalidArgument("Trainer: model is null");
  if (config_.accumulation_steps < 1) {
    throw InvalidArgument("Trainer: accumulation_steps must be at least 1, got " +
                          std::to_string(config_.accumulation_steps));
  }
  if (config_.max_grad_norm < 0) throw InvalidArgument("Trainer: negative max_grad_norm");
  layout_.check(loss_fn_, config_.accumulation_steps, comm_.rank());
  params_ = model_->parameters();
  if (!config_.checkpoint_dir.empty()) {
    checkpoints_.emplace(config_.checkpoint_dir, config_.keep_last);
  }
}

Trainer::Trainer(TrainerWiring wiring, TrainerConfig config, std::shared_ptr<GradNorm> norm)
    : Trainer(std::move(wiring), LossFn{}, std::move(config), std::move(norm)) {}

StepMetrics Trainer::train_step(const std::vector<torch::data::Example<>>& micro_batches) {
  const auto k = static_cast<int64_t>(micro_batches.size());
  if (k != config_.accumulation_steps) {
    throw InvalidArgument("Trainer::train_step on rank " + std::to_string(comm_.rank()) + ": got " +
                          std::to_string(k) + " micro-batches, accumulation_steps is " +
                          std::to_string(config_.accumulation_steps));
  }
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
  const double loss = layout_.step(micro_batches, loss_fn_, tracer);
  const auto tp_after = tp_wait_seconds();
  int64_t samples = 0;
  for (const auto& b : micro_batches) samples += b.data.size(0);
  {
    TraceSpan span(tracer, "finish sync", "train");
    sync_.finish_sync();
  }

  StepMetrics m;
  // The averaged gradients: the model's .grad, or where an optimizer that
  // averages them itself put them (its shard, for ZeRO).
  const auto grads = optimizer_.gradients(params_);
  m.grad_norm = norm_->global_norm(grads);
  if (config_.max_grad_norm > 0) {
    m.clipped = clip_grad_norm(grads, m.grad_norm, config_.max_grad_norm);
  }
  m.lr = lr_at(config_.schedule, position_.step);
  optimizer_.set_lr(m.lr);
  {
    TraceSpan span(tracer, "optimizer", "train");
    optimizer_.step();
  }
  ++position_.step;

  m.comm_bytes = static_cast<int64_t>(bytes_sent() - bytes_before);
  const auto dims_after = dimension_bytes();
  for (size_t i = 0; i < dims_after.size(); ++i) {
    m.comm_bytes_by_dimension[layout_.dimensions()[i].first] =
        static_cast<int64_t>(dims_after[i] - dims_before[i]);
  }
  auto totals = torch::tensor({loss, static_cast<double>(samples)}, torch::kFloat64);
  comm_.all_reduce(totals, {ReduceOp::Sum}).wait();
  // Every rank of a pipeline (and of a mesh's TP group) reports its
  // replica's loss and samples.
  const int copies = layout_.ranks_per_sample();
  m.step = position_.step;
  m.epoch = position_.epoch;
  m.loss = totals[0].item<double>() / comm_.size();
  m.samples = static_cast<int64_t>(totals[1].item<double>()) / copies;
  m.step_seconds = seconds_since(start);
  m.samples_per_s = m.step_seconds > 0 ? static_cast<double>(m.samples) / m.step_seconds : 0.0;
  m.comm_seconds = comm_seconds() - comm_before;
  if (tp_after) m.tp_comm_seconds = *tp_after - *tp_before;
  return m;
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
  for (const auto& c : wiring_.traffic()) bytes += c->stats().total().bytes_sent;
  return bytes;
}

std::vector<uint64_t> Trainer::dimension_bytes() const {
  std::vector<uint64_t> out;
  for (const auto& [name, groups] : layout_.dimensions()) {
    uint64_t bytes = 0;
    for (const auto& c : groups) bytes += c->stats().total().bytes_sent;
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
  data.set_epoch(position_.epoch);
  if (resized_) continue_epoch_order(data);
  const int64_t g = data.global_micro_batch();
  const int64_t steps_per_epoch = data.num_batches() / k;
  if (steps_per_epoch == 0) {
    throw InvalidArgument("Trainer::fit on rank " + std::to_string(comm_.rank()) + ": " +
                          std::to_string(data.num_batches()) +
                          " micro-batches per epoch, fewer than accumulation_steps " +
                          std::to_string(k));
  }
  int64_t total = config_.epochs * steps_per_epoch;
  if (config_.max_steps > 0) total = std::min(total, config_.max_steps);
  if (position_.step == 0 && last_checkpoint_step_ < 0) metrics_.keep_until(-1);

  Progress progress(config_.progress && comm_.rank() == 0, position_.step, total,
                    config_.log_every);
  std::vector<StepMetrics> out;
  auto epoch_start = std::chrono::steady_clock::now();
  while (position_.step < total && position_.epoch < config_.epochs) {
    std::vector<torch::data::Example<>> batches;
    for (int64_t i = 0; i < k; ++i) batches.push_back(data.batch(position_.batch + i));
    position_.batch += k;
    position_.epoch_samples = g > 0 ? position_.batch * g : -1;
    StepMetrics m = train_step(batches);
    metrics_.append(to_json(m));
    progress.update(m);
    out.push_back(m);
    if (callbacks.on_step) callbacks.on_step(m);

    // The epoch is over when the next step has too few micro-batches left.
    if (position_.batch + k > data.num_batches()) {
      progress.finish();
      if (callbacks.on_epoch_end) {
        callbacks.on_epoch_end({position_.epoch, position_.step, seconds_since(epoch_start)});
      }
      ++position_.epoch;
      position_.batch = 0;
      position_.epoch_samples = 0;
      if (position_.epoch < config_.epochs) data.set_epoch(position_.epoch);
      epoch_start = std::chrono::steady_clock::now();
    }
    if (config_.checkpoint_every > 0 && position_.step % config_.checkpoint_every == 0) {
      save_checkpoint();
    }
  }
  progress.finish();
  if (last_checkpoint_step_ != position_.step) save_checkpoint();
  return out;
}

void Trainer::save_checkpoint() {
  if (!checkpoints_) return;
  // Sharded model and optimizer state (ZeRO, FSDP) goes into the
  // checkpoint's dcp folder; other per-rank state (a compressor's error
  // feedback, a pipeline's stages) into each rank's shard file. Both are
  // written (atomic, checksummed) before the gather below, so rank 0 writes
  // the main file, which is what makes the checkpoint exist, only once every
  // rank's part is on disk.
  const bool in_dcp = dcp_state();
  const bool sharded = per_rank_state() && !in_dcp;
  // FSDP: the shards are what each rank saves (an evaluation forward may
  // have left the root's own parameters gathered).
  layout_.before_checkpoint();
  if (in_dcp) {
    auto state = wiring_.dcp_state_dict(nullptr);
    save_buffers_from_rank0(state, *model_, comm_.rank());
    dcp::save(state, dcp_folder(checkpoints_->path_for(position_.step)), comm_);
  }
  if (sharded) write_shard();
  // Every rank's RNG state goes into rank 0's file: one file, one rename,
  // so a crash cannot leave some ranks' parts newer than others.
  auto mine = cpu_rng_state();
  std::vector<torch::Tensor> all;
  if (comm_.rank() == 0) {
    for (int r = 0; r < comm_.size(); ++r) all.push_back(torch::empty_like(mine));
  }
  comm_.gather(all, mine, {0}).wait();
  if (comm_.rank() == 0) {
    const bool model_in_main = !wiring_.per_rank_model() && !in_dcp;
    const auto payload = encode_training_state(model_in_main ? model_.get() : nullptr, optimizer_,
                                               position_, torch::stack(all), in_dcp);
    checkpoints_->write(position_.step, payload);
    // The folders of rotated-out checkpoints, and any a crash left behind.
    remove_orphan_dcp_folders(*checkpoints_, position_.step);
  }
  if (sharded) {
    // After rank 0's rotation, so that every rank sees which checkpoints
    // are gone.
    comm_.barrier().wait();
    remove_stale_shards();
  }
  last_checkpoint_step_ = position_.step;
}

bool Trainer::dcp_state() const {
  // A compressor's per-rank state has no dcp form: such a job keeps its
  // shard files (and its world size).
  return wiring_.has_dcp_state() && !sync_.has_state();
}

bool Trainer::per_rank_state() const {
  return !optimizer_.replicated_state() || sync_.has_state() || wiring_.per_rank_model();
}

void Trainer::write_shard() const {
  torch::serialize::OutputArchive archive;
  if (wiring_.per_rank_model()) {
    torch::serialize::OutputArchive stages;
    model_->save(stages);
    archive.write("model", stages);
  }
  if (!optimizer_.replicated_state()) optimizer_.save(archive);
  if (sync_.has_state()) sync_.save_state(archive);
  std::ostringstream out;
  archive.save_to(out);
  write_checkpoint_file(shard_path(position_.step), out.str());
}

void Trainer::read_shard(int64_t step) {
  // The optimizer checks that the shard was saved by the same rank of the
  // same layout; a model's part, by its shapes.
  const char* part = layout_.per_rank_model() ? "rank's stages" : "rank's shards";
  const auto shard = read_checkpoint_file(shard_path(step));
  try {
    std::istringstream in(shard);
    torch::serialize::InputArchive archive;
    archive.load_from(in);
    if (wiring_.per_rank_model()) {
      torch::serialize::InputArchive stages;
      archive.read("model", stages);
      load_module_state(*model_, stages);
    }
    if (!optimizer_.replicated_state()) optimizer_.load(archive);
    if (sync_.has_state()) sync_.load_state(archive);
  } catch (const CheckpointError& e) {
    throw CheckpointError("checkpoint " + shard_path(step) + ": does not fit this " + part + ": " +
                          e.what());
  } catch (const c10::Error& e) {
    throw CheckpointError("checkpoint " + shard_path(step) + ": does not fit this " +
                          (wiring_.per_rank_model() ? std::string(part) + " or optimizer: "
                                                    : std::string("optimizer: ")) +
                          e.what_without_backtrace());
  }
}

std::string Trainer::shard_path(int64_t step) const {
  return checkpoints_->path_for(step) + ".shard-" + std::to_string(comm_.rank()) + "-of-" +
         std::to_string(comm_.size());
}

void Trainer::remove_stale_shards() const {
  // This rank's shards whose main checkpoint is gone (rotated out by
  // keep_last); the one just written is kept even before rank 0's file
  // appears.
  const auto kept = checkpoints_->steps();
  const std::string suffix =
      ".shard-" + std::to_string(comm_.rank()) + "-of-" + std::to_string(comm_.size());
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(checkpoints_->dir(), ec)) {
    const auto path = entry.path().string();
    if (path.size() <= suffix.size() ||
        path.compare(path.size() - suffix.size(), suffix.size(), suffix) != 0) {
      continue;
    }
    bool keep = false;
    for (int64_t step : kept) keep = keep || shard_path(step) == path;
    if (!keep && shard_path(position_.step) != path) std::filesystem::remove(entry.path(), ec);
  }
}

std::optional<int64_t> Trainer::resume() {
  if (!checkpoints_) return std::nullopt;
  // Rank 0 picks the checkpoint and tells the others, so that all ranks
  // load the same one even if they see the folder differently. A checkpoint
  // whose dcp folder is not whole (no .metadata, a missing data file) is
  // skipped like a file that does not verify.
  std::string payload;
  auto chosen = torch::tensor({int64_t{-1}}, torch::kInt64);
  if (comm_.rank() == 0) {
    auto loaded = checkpoints_->load_latest([&](int64_t step, const std::string& bytes) {
      const auto path = checkpoints_->path_for(step);
      if (training_state_in_dcp(bytes, path)) verify_dcp_folder(dcp_folder(path));
    });
    skipped_ = loaded.skipped;
    for (const auto& why : skipped_) {
      std::fprintf(stderr, "cohort: skipping %s\n", why.c_str());
    }
    if (loaded.found) {
      chosen.fill_(loaded.step);
      payload = std::move(loaded.payload);
      if (!skipped_.empty()) {
        std::fprintf(stderr, "cohort: resuming from the previous good checkpoint %s\n",
                     checkpoints_->path_for(loaded.step).c_str());
      }
    } else if (!skipped_.empty()) {
      std::fprintf(stderr,
                   "cohort: no checkpoint in %s verifies (%zu skipped); starting from step 0\n",
                   checkpoints_->dir().c_str(), skipped_.size());
    }
  }
  comm_.broadcast(chosen, {0}).wait();
  const int64_t step = chosen.item<int64_t>();
  if (step < 0) {
    metrics_.keep_until(-1);
    last_checkpoint_step_ = -1;
    return std::nullopt;
  }
  const std::string path = checkpoints_->path_for(step);
  if (comm_.rank() != 0) payload = checkpoints_->load(step);
  layout_.before_checkpoint();  // FSDP loads into the shards
  auto state = decode_training_state(
      payload, path, wiring_.per_rank_model() ? nullptr : model_.get(), optimizer_,
      [&](int64_t world, bool in_dcp) { check_checkpoint(world, in_dcp, path); });
  if (state.in_dcp) {
    load_dcp(dcp_folder(path));
  } else if (per_rank_state()) {
    read_shard(step);
  }
  const int64_t old_world = state.rng_states.size(0);
  resized_ = old_world != comm_.size();
  if (comm_.rank() < old_world) {
    set_cpu_rng_state(state.rng_states[comm_.rank()]);
  } else {
    // A rank new to the job: its own stream, the same on every resume.
    set_cpu_rng_state(seeded_cpu_rng_state(static_cast<uint64_t>(step) * 1000003u +
                                           static_cast<uint64_t>(comm_.rank())));
  }
  if (resized_ && comm_.rank() == 0) {
    std::fprintf(stderr,
                 "cohort: checkpoint %s (step %lld) was written by %lld ranks; resuming at world "
                 "%d\n",
                 path.c_str(), static_cast<long long>(step), static_cast<long long>(old_world),
                 comm_.size());
  }
  position_ = state.position;
  last_checkpoint_step_ = step;
  metrics_.keep_until(step);
  return step;
}

void Trainer::load_dcp(const std::string& folder) {
  // Every rank reads the metadata (verified) and then only the byte ranges
  // of its own boxes; dcp::load copies nothing unless every rank verified
  // all it read, and throws the same error on every rank otherwise.
  const auto meta = dcp::read_metadata(folder);
  auto state = wiring_.dcp_state_dict(&meta);
  check_state_covers_model(meta, state, comm_, folder);
  dcp::load(state, folder, comm_, &meta);
}

std::string Trainer::sharded_mode() const {
  if (!layout_.describe().empty()) return layout_.describe();
  if (!optimizer_.replicated_state()) return "a sharded optimizer (ZeRO)";
  return "a stateful gradient compressor (per-rank state)";
}

void Trainer::check_checkpoint(int64_t checkpoint_world, bool in_dcp,
                               const std::string& path) const {
  const std::string where =
      "Trainer::resume on rank " + std::to_string(comm_.rank()) + ": checkpoint " + path;
  if (in_dcp) {
    // Sharded state saved through dcp loads into any layout that has a dcp
    // form, at any world size.
    if (dcp_state()) return;
    throw ConfigError(where +
                      " holds ZeRO or FSDP state (a distributed checkpoint), which loads only "
                      "into a ZeRO or FSDP trainer; this one has " +
                      (per_rank_state() ? sharded_mode() : std::string("replicated state")));
  }
  if (checkpoint_world == comm_.size() || !per_rank_state()) return;
  throw ConfigError(where + " was written by " + std::to_string(checkpoint_world) +
                    " ranks, this job has " + std::to_string(comm_.size()) + "; the state of " +
                    sharded_mode() + " resumes only at the world size that wrote it");
}

void Trainer::continue_epoch_order(const DataSource& data) {
  // The same samples of the epoch's global order are done at any world
  // size; the micro-batch index that follows them depends on the size.
  resized_ = false;
  if (position_.batch == 0 && position_.epoch_samples <= 0) return;
  const int64_t g = data.global_micro_batch();
  if (g <= 0 || position_.epoch_samples < 0 || position_.epoch_samples % g != 0) {
    throw ConfigError(
        "Trainer::fit on rank " + std::to_string(comm_.rank()) +
        ": resumed at a new world size in the middle of epoch " + std::to_string(position_.epoch) +
        (g <= 0 || position_.epoch_samples < 0
             ? std::string(", but the data source (or the checkpoint's) has no global sample "
                           "order (DataSource::global_micro_batch)")
             : ", after " + std::to_string(position_.epoch_samples) +
                   " samples, which is not a whole number of global micro-batches of " +
                   std::to_string(g) + "; keep the global batch the same"));
  }
  position_.batch = position_.epoch_samples / g;
}

void Trainer::log_eval(const nlohmann::json& fields) {
  nlohmann::json line = {{"kind", "eval"}, {"step", position_.step}, {"epoch", position_.epoch}};
  for (auto it = fields.begin(); it != fields.end(); ++it) line[it.key()] = it.value();
  metrics_.append(line);
}

}  // namespace cohort
