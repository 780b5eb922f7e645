// defines: TrainingPosition and encode/decode of a checkpoint's payload:
// position (step, epoch, micro-batch index), world size and every rank's
// RNG state, in one torch::serialize archive.
//
// The model and optimizer are in the checkpoint's dcp folder (see Trainer).
// The RNG states differ per rank (dropout draws), so rank 0 gathers them
// and stores one row per rank.
#pragma once

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace cohort {

/// Where training is: the position a checkpoint restores.
struct TrainingPosition {
  int64_t step = 0;   ///< optimizer steps done
  int64_t epoch = 0;  ///< epoch of the next micro-batch
  int64_t batch = 0;  ///< index of the next micro-batch in that epoch
  /// Samples of the epoch's global order all ranks together have consumed
  /// (batch x DataSource::global_micro_batch()); -1 when the source has no
  /// global order. What a resume continues from: another world size,
  /// micro-batch or accumulation cuts the epoch into other micro-batches.
  int64_t epoch_samples = 0;
  /// DataSource::num_batches() of the job that wrote it (0: unknown). Without
  /// a global order, `batch` means the same samples only when this is the same.
  int64_t epoch_batches = 0;
  /// Samples of one optimizer step over all ranks (micro-batch x
  /// accumulation_steps x data-parallel size) of the job that wrote it; 0:
  /// unknown (no step yet, or a checkpoint older than this record). fit()
  /// refuses to continue with another: the epoch's steps and the samples
  /// done would no longer line up.
  int64_t global_batch = 0;
  /// DataSource::order_settings() of the job that wrote it ("": not said).
  /// A resume in the middle of an epoch refuses another: `batch` and
  /// `epoch_samples` count the samples of the epoch's order under these.
  std::string data_order;
  /// The dataset's size (DataShard::samples) of the job that wrote it; -1:
  /// not said. Without a global order, `batch` means the same samples only
  /// in a dataset of this size.
  int64_t data_samples = -1;
  /// Data-parallel replicas (world size / TrainerLayout::ranks_per_sample)
  /// of the job that wrote it; 0: unknown. Without a global order, `batch`
  /// counts micro-batches of that many shares of the epoch.
  int64_t data_parallel = 0;
};

/// rng_states: [world_size, state_bytes] uint8, row r is rank r's state.
/// The payload marks the model and optimizer state as being in the
/// checkpoint's dcp folder (dcp_checkpoint.h).
/// initial_lr_records: row r rank r's record of its optimizer parameter
/// groups' rates when the Trainer was made, which its learning-rate
/// schedule scales, keyed by the groups' parameters (initial_lrs.h; none:
/// not recorded).
/// device_rng_states: [world_size, state_bytes] of the generator of each
/// rank's accelerator (its model's CUDA device); undefined for a model on
/// the CPU.
/// rng_streams: [world_size, bytes], row r rank r's rng_streams_state
/// (rng_state.h: the model's own random streams), zero-padded to the
/// longest; undefined when no rank's model has any.
std::string encode_training_state(const TrainingPosition& position, const torch::Tensor& rng_states,
                                  const std::vector<std::string>& initial_lr_records = {},
                                  const torch::Tensor& device_rng_states = {},
                                  const torch::Tensor& rng_streams = {});

/// True when `payload` (verified) keeps its model and optimizer state in
/// the checkpoint's dcp folder. Throws CheckpointError naming `source` when
/// it does not parse.
bool training_state_in_dcp(const std::string& payload, const std::string& source);

/// A checkpoint's contents, decoded.
struct DecodedState {
  /// Where training was.
  TrainingPosition position;
  torch::Tensor rng_states;  ///< [world_size, state_bytes]
  /// [world_size, state_bytes] of each rank's accelerator generator;
  /// undefined when the job that wrote it trained on the CPU.
  torch::Tensor device_rng_states;
  /// [world_size, bytes] of each rank's model's own random streams;
  /// undefined when the job that wrote it had none.
  torch::Tensor rng_streams;
  /// Each rank's record of its parameter groups' initial rates
  /// (initial_lrs.h); empty in a checkpoint written before they were.
  std::vector<std::string> initial_lr_records;
  /// An older checkpoint's record: rank 0's rate of each group, by index;
  /// empty when not recorded.
  std::vector<double> initial_lrs;
};

/// What wrote a checkpoint, as far as its payload says.
struct CheckpointKind {
  int64_t world = 0;           ///< the number of ranks that wrote it
  bool in_dcp = false;         ///< the model and optimizer state are in its dcp folder
  bool model_in_file = false;  ///< the model is in this file (an earlier cohort's)
};

/// Called with what wrote the checkpoint before anything is loaded; throws to refuse it.
using CheckpointCheck = std::function<void(const CheckpointKind& kind)>;

/// Decodes `payload` (nothing of the model or optimizer: they are in the
/// dcp folder). Throws CheckpointError (naming `source`) when it does not
/// parse; what `check` throws, unchanged.
DecodedState decode_training_state(const std::string& payload, const std::string& source,
                                   const CheckpointCheck& check = {});

}  // namespace cohort
