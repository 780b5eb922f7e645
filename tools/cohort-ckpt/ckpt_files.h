// defines: inspect_checkpoint, consolidate_checkpoint, export_checkpoint and
// import_weights: the library half of cohort-ckpt over a distributed
// checkpoint folder (cohort/dcp).
#pragma once

#include <string>
#include <vector>

#include "cohort/dcp/safetensors.h"

namespace cohort_ckpt {

/// The checkpoint's tensors as text: name, dtype, global shape, layout, and
/// per chunk its file, box, byte offset and crc32s. `verify`: also read
/// every chunk and check its checksums (throws CheckpointError on a bad one).
std::string inspect_checkpoint(const std::string& dir, bool verify);

/// Writes the tensors named `prefix`<fqn> ("model." by default: the
/// model's parameters and buffers), whole, to `out` as the archive that
/// torch::save(module, out) writes, so torch::load(module, out) loads them
/// into the bare model. Returns the number of tensors written.
int consolidate_checkpoint(const std::string& dir, const std::string& out,
                           const std::string& prefix = "model.");

/// The tensors named `prefix`<fqn>, whole (gathered from any layout: DDP,
/// ZeRO, FSDP, TP x PP), under their bare names <fqn>, in name order.
cohort::dcp::NamedTensors model_tensors(const std::string& dir,
                                        const std::string& prefix = "model.");

/// What export_checkpoint writes.
struct ExportOptions {
  std::string format = "safetensors";  ///< "safetensors" or "torch" (torch.save's dict)
  std::string prefix = "model.";       ///< the tensors to write, named without it
  int64_t max_shard_bytes = 0;         ///< safetensors: shards with an index above it (0: never)
};

/// Writes the checkpoint's model tensors to `out` for the Python world
/// (safetensors, or a dict of tensors that torch.load reads). Returns the
/// files written.
std::vector<std::string> export_checkpoint(const std::string& dir, const std::string& out,
                                           const ExportOptions& options = {});

/// Writes the tensors of a safetensors file (or index) or torch.save file as
/// a distributed checkpoint in folder `dir` (named `prefix` + their names,
/// every module their names imply listed), which dcp::load reads into any
/// mode at any world size and consolidate turns into a LibTorch archive.
/// Returns the number of tensors.
int import_weights(const std::string& file, const std::string& dir,
                   const std::string& prefix = "model.");

}  // namespace cohort_ckpt
