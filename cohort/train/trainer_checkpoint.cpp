// The Trainer's checkpoints: save_checkpoint and resume (the rest of
// Trainer is in trainer.cpp).
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"
#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/dcp.h"
#include "cohort/train/dcp_checkpoint.h"
#include "cohort/train/initial_lrs.h"
#include "cohort/train/rng_state.h"
#include "cohort/train/trainer.h"
#include "cohort/train/training_state.h"

namespace cohort {
namespace {

// A part of a checkpoint that does not verify, met by some rank while
// loading; thrown alike on every rank, which then falls back to an older
// checkpoint. A checkpoint that verifies but does not fit the model is a
// plain CheckpointError or ConfigError: an older one would not fit either.
class DamagedCheckpoint : public CheckpointError {
 public:
  using CheckpointError::CheckpointError;
};

// Runs `read` (this rank's read of a part of a checkpoint); a CheckpointError
// on any rank becomes the same DamagedCheckpoint on every rank.
void read_on_every_rank(Communicator& comm, const std::function<void()>& read) {
  std::string error;
  try {
    read();
  } catch (const CheckpointError& e) {
    error = e.what();
  }
  try {
    dcp::agree(comm, error);
  } catch (const CheckpointError& e) {
    throw DamagedCheckpoint(e.what());
  }
}

// The accelerator this rank trains on: its model's device, unless the CPU.
std::optional<torch::Device> accelerator_of(const torch::nn::Module& model) {
  for (const auto& p : model.parameters()) {
    if (!p.device().is_cpu()) return p.device();
  }
  return std::nullopt;
}

// Every rank's RNG states gathered on rank 0 ([world, bytes] each): the CPU
// generator's, on an accelerator its generator's (undefined on the CPU),
// and the model's own streams (rng_state.h; undefined when no rank's model
// has any); with them every rank's `lr_record` (initial_lrs.h). One gather
// of all four. The generators' length is agreed first, so that ranks on
// different kinds of device fail alike; the streams and records may differ
// (pipeline stages of different modules and groups) and are padded to the
// longest.
struct GatheredRng {
  torch::Tensor cpu, device, streams;
  std::vector<std::string> lr_records;
};

torch::Tensor padded(torch::Tensor bytes, int64_t length) {
  if (bytes.numel() >= length) return bytes;
  return torch::cat({bytes, torch::zeros({length - bytes.numel()}, torch::kUInt8)});
}

GatheredRng gather_rng_states(Communicator& comm, const torch::nn::Module& model,
                              const std::string& lr_record) {
  const auto cpu = cpu_rng_state();
  const auto device = accelerator_of(model);
  const auto generators = device ? torch::cat({cpu, device_rng_state(*device)}) : cpu;
  auto streams = rng_streams_state(rng_streams_of(model));
  auto record = torch::empty({static_cast<int64_t>(lr_record.size())}, torch::kUInt8);
  std::memcpy(record.data_ptr<uint8_t>(), lr_record.data(), lr_record.size());
  auto lengths = torch::tensor(
      {generators.numel(), -generators.numel(), streams.numel(), record.numel()}, torch::kInt64);
  comm.all_reduce(lengths, {ReduceOp::Max}).wait();
  if (lengths[0].item<int64_t>() != -lengths[1].item<int64_t>()) {
    throw ConfigError("Trainer checkpoint on rank " + std::to_string(comm.rank()) +
                      ": the ranks' RNG states differ in size (this rank's " +
                      std::to_string(generators.numel()) + " bytes" +
                      (device ? " with " + device->str() + "'s" : " with no accelerator's") +
                      "): every rank must train on the same kind of device");
  }
  const int64_t streams_length = lengths[2].item<int64_t>();
  const int64_t record_length = lengths[3].item<int64_t>();
  const auto row =
      torch::cat({generators, padded(streams, streams_length), padded(record, record_length)});
  std::vector<torch::Tensor> all;
  if (comm.rank() == 0) {
    for (int r = 0; r < comm.size(); ++r) all.push_back(torch::empty_like(row));
  }
  comm.gather(all, row, {0}).wait();
  if (comm.rank() != 0) return {};
  const auto rows = torch::stack(all);
  const int64_t n = generators.numel();
  GatheredRng out;
  out.cpu = rows.narrow(1, 0, cpu.numel()).contiguous();
  if (device) out.device = rows.narrow(1, cpu.numel(), n - cpu.numel()).contiguous();
  if (streams_length > 0) out.streams = rows.narrow(1, n, streams_length).contiguous();
  const auto records = rows.narrow(1, n + streams_length, record_length).contiguous();
  for (int r = 0; r < comm.size(); ++r) {
    if (record_length == 0) {
      out.lr_records.emplace_back();
      continue;
    }
    const auto* bytes = reinterpret_cast<const char*>(records[r].data_ptr<uint8_t>());
    out.lr_records.emplace_back(bytes, strnlen(bytes, static_cast<size_t>(record_length)));
  }
  return out;
}

// This rank's generators as the checkpoint has them. A rank new to the job
// (or an accelerator the checkpoint has no state of: it was written on the
// CPU) gets its own stream, the same on every resume. With `check_only`,
// only whether the accelerator's generator takes its state, nothing set:
// the generators are set once the load succeeded, so a checkpoint skipped
// as damaged leaves them as they were.
void restore_rng_states(int rank, const torch::nn::Module& model, const DecodedState& state,
                        int64_t old_world, int64_t step, const std::string& path, bool check_only) {
  const uint64_t seed = static_cast<uint64_t>(step) * 1000003u + static_cast<uint64_t>(rank);
  if (!check_only) {
    set_cpu_rng_state(rank < old_world ? state.rng_states[rank] : seeded_cpu_rng_state(seed));
  }
  const auto device = accelerator_of(model);
  if (!device) return;
  if (rank >= old_world || !state.device_rng_states.defined()) {
    if (!check_only) seed_device_rng(*device, seed);
    return;
  }
  try {
    if (check_only) {
      check_device_rng_state(*device, state.device_rng_states[rank]);
    } else {
      set_device_rng_state(*device, state.device_rng_states[rank]);
    }
  } catch (const c10::Error& e) {
    throw CheckpointError("Trainer::resume on rank " + std::to_string(rank) + ": checkpoint " +
                          path + " has an RNG state that " + device->str() +
                          "'s generator does not take: " + e.what_without_backtrace());
  }
}

}  // namespace

void Trainer::save_checkpoint() {
  if (!checkpoints_) return;
  finish_checkpoint();
  // FSDP: the shards are what each rank saves (an evaluation forward may
  // have left the root's own parameters gathered).
  layout_.before_checkpoint();
  auto state = plan_.dcp_state_dict(nullptr);
  // Every rank's RNG states and its groups' initial rates (keyed by their
  // parameters' names in the state dict) go into rank 0's file: one file,
  // one rename, so a crash cannot leave some ranks' parts newer than
  // others. Gathered before the save, so that a refusal leaves none started.
  const auto rng = gather_rng_states(
      comm_, *model_, encode_initial_lrs(group_parameter_names(optimizer_, state), initial_lrs_));
  // The model, optimizer and gradient-sync state go into the checkpoint's
  // dcp folder (every rank its data file, then .metadata, which rank 0
  // writes once every rank's part is on disk) before rank 0 writes the main
  // file, which is what makes the checkpoint exist.
  save_buffers_from_rank0(state, *model_, comm_.rank());
  // Without a broadcast before each forward, every rank's buffers are its
  // own batches' statistics, which a resume at this world size gives back.
  if (!plan_.broadcasts_buffers()) add_rank_buffers(state, *model_, comm_.rank());
  if (sync_.has_state()) add_sync_state(state, sync_.state(), comm_.rank());
  const auto folder = dcp_folder(checkpoints_->path_for(position_.step));
  if (config_.async_checkpoint) {
    pending_ = PendingCheckpoint{dcp::async_save(state, folder, comm_), position_.step, ""};
  } else {
    dcp::save(state, folder, comm_);
  }
  std::string payload;  // rank 0's
  if (comm_.rank() == 0) {
    payload = encode_training_state(position_, rng.cpu, rng.lr_records, rng.device, rng.streams);
  }
  if (pending_) {
    pending_->payload = std::move(payload);  // written once the dcp part is committed
  } else {
    write_main_file(position_.step, payload);
  }
  last_checkpoint_step_ = position_.step;
}

void Trainer::write_main_file(int64_t step, const std::string& payload) {
  // Rank 0 writes; a failure (a full disk) is agreed, so that the other
  // ranks throw it too rather than train on into a collective rank 0 never
  // joins, or return from fit() as if the checkpoint existed.
  std::string error;
  if (comm_.rank() == 0) {
    try {
      checkpoints_->write(step, payload);
      // The folders of rotated-out checkpoints, and any a crash left behind.
      remove_orphan_dcp_folders(*checkpoints_, step);
    } catch (const std::exception& e) {
      error = "Trainer checkpoint of step " + std::to_string(step) + ": " + e.what();
    }
  }
  dcp::agree(comm_, error);
}

Trainer::~Trainer() {
  // No collective here: the other ranks may be gone, or unwinding an error.
  if (!pending_ || comm_.rank() != 0) return;
  std::fprintf(stderr,
               "cohort: Trainer destroyed with the async checkpoint of step %lld not committed: "
               "resume() will not find it; call Trainer::finish_checkpoint() on every rank after "
               "the last save_checkpoint()\n",
               static_cast<long long>(pending_->step));
}

void Trainer::finish_checkpoint() {
  if (!pending_) return;
  auto pending = std::move(*pending_);
  pending_.reset();
  // Collective: every rank's data file is on disk and rank 0 wrote the
  // folder's .metadata, or every rank throws the failing rank's error.
  pending.save.wait();
  write_main_file(pending.step, pending.payload);
}

std::optional<int64_t> Trainer::resume() {
  if (!checkpoints_) return std::nullopt;
  finish_checkpoint();
  skipped_.clear();
  int64_t below = std::numeric_limits<int64_t>::max();
  for (;;) {
    std::string payload;
    const auto [step, skipped] = choose_checkpoint(below, payload);
    if (step < 0) return start_fresh(skipped);
    try {
      load_checkpoint(step, std::move(payload));
    } catch (const DamagedCheckpoint& e) {
      skipped_.push_back(e.what());
      if (comm_.rank() == 0) std::fprintf(stderr, "cohort: skipping %s\n", e.what());
      below = step;
      continue;
    }
    if (comm_.rank() == 0 && !skipped_.empty()) {
      std::fprintf(stderr, "cohort: resuming from the previous good checkpoint %s\n",
                   checkpoints_->path_for(step).c_str());
    }
    return step;
  }
}

std::pair<int64_t, int64_t> Trainer::choose_checkpoint(int64_t below, std::string& payload) {
  // Rank 0 picks the newest checkpoint below `below` and tells the others,
  // so that all ranks load the same one even if they see the folder
  // differently. A checkpoint whose dcp folder is not whole (no .metadata,
  // a missing data file) is skipped like a file that does not verify
  // (dcp_folder_check, the CheckpointDir's).
  auto chosen = torch::tensor({int64_t{-1}, int64_t{0}}, torch::kInt64);
  if (comm_.rank() == 0) {
    auto loaded = checkpoints_->load_latest({}, below);
    for (const auto& why : loaded.skipped) {
      if (std::find(skipped_.begin(), skipped_.end(), why) != skipped_.end()) continue;
      skipped_.push_back(why);
      std::fprintf(stderr, "cohort: skipping %s\n", why.c_str());
    }
    if (loaded.found) {
      chosen[0].fill_(loaded.step);
      payload = std::move(loaded.payload);
    }
    chosen[1].fill_(static_cast<int64_t>(skipped_.size()));
  }
  comm_.broadcast(chosen, {0}).wait();
  return {chosen[0].item<int64_t>(), chosen[1].item<int64_t>()};
}

std::optional<int64_t> Trainer::start_fresh(int64_t skipped) {
  if (skipped > 0) {
    // Starting over would quietly throw away the run the checkpoints hold.
    std::string error;
    if (comm_.rank() == 0) {
      error = "Trainer::resume: no checkpoint in " + checkpoints_->dir() + " verifies (" +
              std::to_string(skipped) + " skipped; the newest: " + skipped_.front() + ")";
    }
    if (!config_.start_fresh_if_damaged) {
      dcp::agree(comm_, error.empty() ? error
                                      : error +
                                            "; repair or remove them, or set "
                                            "TrainerOptions::start_fresh_if_damaged to train "
                                            "from step 0");
    }
    if (comm_.rank() == 0) {
      std::fprintf(stderr,
                   "cohort: no checkpoint in %s verifies (%lld skipped); starting from step 0 "
                   "(start_fresh_if_damaged)\n",
                   checkpoints_->dir().c_str(), static_cast<long long>(skipped));
    }
  }
  metrics_.keep_until(-1);
  last_checkpoint_step_ = -1;
  return std::nullopt;
}

void Trainer::load_checkpoint(int64_t step, std::string payload) {
  const std::string path = checkpoints_->path_for(step);
  read_on_every_rank(comm_, [&] {
    if (comm_.rank() != 0) payload = checkpoints_->load(step);
  });
  layout_.before_checkpoint();  // FSDP loads into the shards
  // Every part is read and verified before anything is loaded, so a damaged
  // one leaves the model as it was for the fall-back.
  auto state = decode_training_state(
      payload, path, [&](const CheckpointKind& kind) { check_checkpoint(kind, path); });
  const int64_t old_world = state.rng_states.size(0);
  // The schedule's initial rates: the optimizer's groups now hold the last
  // scheduled ones, which scaled again would compound. Matched before
  // anything is loaded, and agreed: a group one rank cannot match is
  // refused on every rank.
  std::vector<double> initial_lrs = initial_lrs_;
  std::string lr_error;
  try {
    initial_lrs = resumed_initial_lrs(state, path);
  } catch (const ConfigError& e) {
    lr_error = e.what();
  }
  dcp::agree(comm_, lr_error, dcp::ErrorKind::Config);
  // The generators checked before the model, agreed: a state this device's
  // generator does not take is refused on every rank with nothing loaded.
  // They are set only once the load succeeded: nothing of a checkpoint
  // skipped as damaged is kept.
  std::string rng_error;
  try {
    restore_rng_states(comm_.rank(), *model_, state, old_world, step, path, /*check_only=*/true);
  } catch (const CheckpointError& e) {
    rng_error = e.what();
  }
  dcp::agree(comm_, rng_error);
  load_dcp(dcp_folder(path), old_world);
  restore_rng_states(comm_.rank(), *model_, state, old_world, step, path, /*check_only=*/false);
  // The model's own streams: collective, each set over its own groups.
  const bool has_streams = comm_.rank() < old_world && state.rng_streams.defined();
  restore_rng_streams(rng_streams_of(*model_),
                      has_streams ? state.rng_streams[comm_.rank()] : torch::Tensor(), step);
  initial_lrs_ = std::move(initial_lrs);
  resized_ = old_world != comm_.size();
  resumed_ = true;
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
}

std::vector<double> Trainer::resumed_initial_lrs(const DecodedState& state,
                                                 const std::string& path) {
  const std::string where =
      "Trainer::resume on rank " + std::to_string(comm_.rank()) + ": checkpoint " + path + ": ";
  if (!state.initial_lr_records.empty()) {
    auto now = plan_.dcp_state_dict(nullptr);
    return match_initial_lrs(state.initial_lr_records, group_parameter_names(optimizer_, now),
                             initial_lrs_, where);
  }
  // An older checkpoint recorded rank 0's rates by group index.
  if (state.initial_lrs.empty()) return initial_lrs_;
  if (state.initial_lrs.size() != initial_lrs_.size()) {
    throw ConfigError(where + "it has the learning-rate schedule's rates of " +
                      std::to_string(state.initial_lrs.size()) +
                      " optimizer parameter groups, this trainer's optimizer has " +
                      std::to_string(initial_lrs_.size()) +
                      "; resume with the optimizer's parameter groups that wrote it");
  }
  return state.initial_lrs;
}

void Trainer::load_dcp(const std::string& folder, int64_t old_world) {
  // Every rank reads the metadata (verified) and then only the byte ranges
  // of its own boxes; dcp::load copies nothing unless every rank verified
  // all it read, and throws the same error on every rank otherwise. Whether
  // the checkpoint fits the model is settled first: what fails after that
  // is the data on disk, and an older checkpoint may be whole.
  dcp::Metadata meta;
  read_on_every_rank(comm_, [&] { meta = dcp::read_metadata(folder); });
  check_sync_state(meta, old_world, folder);
  auto state = plan_.dcp_state_dict(&meta);
  check_state_covers_model(meta, state, comm_, folder);
  if (sync_.has_state()) {
    add_sync_targets(
        state, meta, comm_.rank(),
        [this](const std::map<std::string, torch::Tensor>& s) { sync_.check_state(s); },
        [this](const std::map<std::string, torch::Tensor>& s) { sync_.load_state(s); });
  }
  if (!plan_.broadcasts_buffers() && old_world == comm_.size()) {
    add_rank_buffer_targets(state, meta, *model_, comm_.rank());
  }
  std::string misfit;
  try {
    dcp::check_fits(state, meta, folder);
  } catch (const CheckpointError& e) {
    misfit = e.what();
  }
  dcp::agree(comm_, misfit);
  try {
    dcp::load(state, folder, comm_, &meta);
  } catch (const CheckpointError& e) {
    throw DamagedCheckpoint(e.what());
  }
}

void Trainer::check_sync_state(const dcp::Metadata& meta, int64_t old_world,
                               const std::string& folder) const {
  // Every rank reads the same metadata, so every rank throws alike.
  if (!holds_sync_state(meta)) return;
  const std::string where =
      "Trainer::resume on rank " + std::to_string(comm_.rank()) + ": checkpoint " + folder;
  if (!sync_.has_state()) {
    throw ConfigError(where +
                      " holds each rank's state of a stateful gradient compressor (its error "
                      "feedback), which this trainer (" +
                      plan_.mode() + ") does not run: resume with the compressor that wrote it");
  }
  // Each rank's error feedback is its own gradients' residual: it has no
  // meaning on another rank, nor summed or split over other ranks.
  if (old_world == comm_.size()) return;
  throw ConfigError(where + " was written by " + std::to_string(old_world) +
                    " ranks, this job has " + std::to_string(comm_.size()) +
                    "; the per-rank state of its stateful gradient compressor (error feedback) "
                    "cannot be resharded: resume at " +
                    std::to_string(old_world) + " ranks");
}

void Trainer::check_checkpoint(const CheckpointKind& kind, const std::string& path) const {
  // Saved through dcp: loads into any wiring at any world size (the
  // gradient sync's state: see check_sync_state).
  if (kind.in_dcp) return;
  // An earlier cohort's checkpoint has no dcp folder; refused here by what
  // it is, before anything is loaded, rather than skipped as damaged when
  // the folder is not found.
  throw ConfigError("Trainer::resume on rank " + std::to_string(comm_.rank()) + ": checkpoint " +
                    path + " was written by an earlier cohort " +
                    (kind.model_in_file ? "that held the model and optimizer in this file"
                                        : "with per-rank shard files") +
                    ", which this version no longer reads; resume from a checkpoint of this "
                    "version");
}

}  // namespace cohort
