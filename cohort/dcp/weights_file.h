// defines: load_weights and LoadWeightsOptions: the tensors of a state dict
// (any mode's: a model's parameters and buffers, before or after wrapping)
// initialized from a safetensors or torch.save file (a published model's
// weights). state_dict/state_dict.h has the overload for a module held
// whole or a fully sharded root:
//
//   dcp::load_weights(*model, "model.safetensors");            // state_dict/state_dict.h
//   auto sd = dcp::get_state_dict(*stage, {&mesh, tied});       // every tensor it holds
//   dcp::load_weights(sd, "model.safetensors.index.json",
//                     {.allow_unexpected = true, .comm = mesh.process_group().get()});
//
// The file's names are the bare model's (state_dict() keys); the state
// dict's are "model." + those (state_dict/state_dict.h). Each shard of the state dict
// (FSDP's dim-0 rows, TP's column, row or vocabulary slices, a pipeline
// stage's tensors) is read from a safetensors file as just its bytes: a
// range of rows is one pread, a slice along a later dim one pread per
// contiguous run. A torch.save file has no per-tensor offsets that
// pickle_load exposes: it is read whole and sliced.
#pragma once

#include <string>

#include "cohort/comm/communicator.h"
#include "cohort/dcp/dcp.h"

namespace cohort::dcp {

/// How load_weights matches the file to the model.
struct LoadWeightsOptions {
  /// Tensors of the model that the file lacks keep their values (else an
  /// error naming them).
  bool allow_missing = false;
  /// Tensors of the file that the model does not hold are skipped (else an
  /// error naming them). A pipeline stage, which holds only its own
  /// tensors, sets it.
  bool allow_unexpected = false;
  /// The state dict's name of file tensor n is prefix + n; state dict
  /// tensors without it (optimizer state) are left alone.
  std::string prefix = "model.";
  /// Set: collective over it, and an error on any rank is thrown on every
  /// rank before any rank changes a tensor.
  Communicator* comm = nullptr;
};

/// Fills this rank's shards of the state dict's tensors from the safetensors
/// file (or index) or torch.save file at `path`, converting the dtype as
/// load_state_dict does. A tensor the file lacks or holds with another
/// shape, or a bad file, is a CheckpointError naming the file and tensor,
/// thrown before anything changes. Returns the number of shards filled.
int load_weights(StateDict& state, const std::string& path, const LoadWeightsOptions& options = {});

}  // namespace cohort::dcp
