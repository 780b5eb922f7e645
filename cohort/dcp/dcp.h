// defines: StateDict and dcp::save / dcp::load / read_metadata, the
// distributed checkpoint (after torch.distributed.checkpoint):
//
//   dcp::save(dcp::get_state_dict(model, opt), dir, comm);   // every rank
//   auto sd = dcp::get_state_dict(model, opt);                // fresh objects
//   dcp::load(sd, dir, comm);                                 // any world size
//   dcp::set_state_dict(model, opt, sd);
//
// (tests/dcp/state_dict_test.cpp runs exactly this.) A StateDict is this
// rank's view of the logical tensors: for each its name, global shape and
// dtype, and the boxes of it this rank holds (state_dict/state_dict.h builds
// one for every mode). Saving writes each rank's boxes to its own file; a
// replicated tensor (every rank holds all of it) is written once, by one
// rank, the tensors spread over the ranks by bytes. Loading reads, for each
// box this rank holds, only the checksum blocks of the stored chunks that
// overlap it (pread), whatever layout and world size wrote them. Both are
// collective: an error on any rank (bad metadata, a missing or truncated
// file, a checksum mismatch, a name or shape that differs) is thrown on
// every rank, naming the file or tensor, and load writes nothing into the
// state dict's tensors unless every rank read and verified all it needs.
#pragma once

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/dcp/metadata.h"

namespace cohort::dcp {

/// A box of a logical tensor that this rank holds; `data` has the box's
/// lengths as its shape (a view into the model or optimizer: load copies
/// into it).
struct LocalShard {
  Box box;             ///< where it sits in the logical tensor
  torch::Tensor data;  ///< its values, shaped as box.lengths
};

/// One logical tensor as this rank sees it.
struct TensorEntry {
  std::string fqn;                     ///< "model.<name>" or "optim.<name>.<state>"
  std::vector<int64_t> shape;          ///< the global shape
  torch::Dtype dtype = torch::kFloat;  ///< every rank's shards have it
  /// Every rank holds the whole tensor, the same values: saved once.
  bool replicated = false;
  /// The boxes this rank holds (none: this rank holds nothing of it).
  std::vector<LocalShard> shards;
  /// This rank writes its boxes; false where another rank holding the same
  /// values does (a tensor-parallel replica, a parameter's step count
  /// another rank saves): they are loaded all the same.
  bool write = true;
};

/// This rank's view of everything a checkpoint holds (get_state_dict,
/// state_dict/state_dict.h, builds one for every mode).
struct StateDict {
  std::vector<TensorEntry> tensors;  ///< in the same order on every rank
  /// The names of the model's submodules ("model.<name>"), so that a
  /// consolidated checkpoint can hold the archive of each, as
  /// torch::save(module) does. The checkpoint holds every rank's (a
  /// pipeline's ranks each hold their own stages).
  std::vector<std::string> modules;
  /// Run by load() in order, after every tensor is in place (installs
  /// optimizer state that did not exist before the load).
  std::vector<std::function<void()>> after_load;
  /// Run by load() on this rank's staged values before the ranks agree (and
  /// by set_state_dict before it copies), each given a function that
  /// returns the value a shard is about to take, found by the shard's
  /// `data`: one that throws refuses the load on every rank, with its
  /// error, before anything changes (values that after_load could not set
  /// together, such as two options of one parameter group).
  std::vector<std::function<void(const std::function<torch::Tensor(const torch::Tensor&)>&)>>
      check_before_load;
  /// Run by save() and async_save() (at the call) before anything is read,
  /// and by set_state_dict on its source: copies into the shards what they
  /// cannot view (a step count or a group option, which the optimizer holds
  /// as a number), so that what is written is the current value.
  std::vector<std::function<void()>> refresh;
  /// Run with the operation's name by save() and async_save() (at the
  /// call), load(), load_weights() and set_state_dict (on both its state
  /// dicts) before anything is read or written: one that throws refuses the
  /// operation (on every rank, where it is collective). A model that this
  /// state dict can no longer save or load truly refuses so: a fully
  /// sharded parameter whose storage was replaced after fully_shard (its
  /// unit holds other values than the parameter shows).
  std::vector<std::function<void(const std::string& op)>> check_model;
  /// The state dict rebuilt for loading a checkpoint with this metadata:
  /// targets for everything the checkpoint holds for this model and
  /// optimizer, the state an optimizer that has not stepped lacks included.
  /// get_state_dict sets it, and load() loads into what it returns, so a
  /// state dict built before the checkpoint was known loads everything.
  std::function<StateDict(const Metadata&)> load_targets;
  /// Each returns "" while this state dict views all the optimizer state
  /// that get_state_dict would view now, else what changed: an optimizer
  /// makes state after a state dict was made (LibTorch's make a parameter's
  /// at its first step with a gradient, so one made at setup views none),
  /// or replaces the tensors it views.
  std::vector<std::function<std::string()>> stale;
  /// The state dict get_state_dict would make now, which save(),
  /// async_save() and set_state_dict (for its source) use in place of a
  /// stale one, so that a state dict kept across training writes all the
  /// optimizer holds. Given this state dict: it throws InvalidArgument when
  /// `tensors` was changed after it was made (the new one would lack the
  /// change). get_state_dict sets it.
  std::function<StateDict(const StateDict& self)> rebuild;
};

/// `state`, or, when a `stale` check of it fails, `state.rebuild(state)`
/// (held in `rebuilt`). Throws InvalidArgument naming `op`, `rank` (unless <
/// 0) and what changed when it is stale and cannot be rebuilt.
const StateDict& current(const StateDict& state, StateDict& rebuilt, const std::string& op,
                         int rank);

/// Throws InvalidArgument naming `op`, the tensor, `rank` (unless < 0) and both shapes
/// when a shard's data is not shaped as its box (a [4, 3] tensor under a
/// [3, 4] box would be read or written permuted) or not of the tensor's
/// dtype.
void check_shards(const StateDict& state, const std::string& op, int rank);

/// The data file of `rank` in a checkpoint folder.
std::string data_file_name(int rank);

/// Writes the checkpoint into folder `dir` (created with any missing parent
/// folders; every rank must see the same folder). Collective over `comm`.
/// Before any rank writes or removes anything in the folder, every rank
/// checks every rank's plan (each tensor's shape, dtype and layout, the
/// replicated tensors, shards that tile each tensor): a disagreement is an
/// InvalidArgument on every rank, and the folder's checkpoint stays whole. A
/// folder that cannot be created is a CheckpointError on every rank.
void save(const StateDict& state, const std::string& dir, Communicator& comm);

/// Reads and verifies `dir`/.metadata.
Metadata read_metadata(const std::string& dir);

/// Throws CheckpointError naming `dir` and the tensor when a tensor of
/// `state` is not in `meta`, or has another shape or dtype there: whether the
/// checkpoint fits the model, apart from its data (load() checks it first).
/// Not collective.
void check_fits(const StateDict& state, const Metadata& meta, const std::string& dir);

/// Fills every shard of `state` from the checkpoint in `dir`, and so the
/// model and optimizer it views. With state.load_targets: everything the
/// checkpoint holds for them, and `state` becomes what was loaded into
/// (views of all they now hold). Collective. `meta`: the checkpoint's
/// metadata when the caller has read it already.
void load(StateDict& state, const std::string& dir, Communicator& comm,
          const Metadata* meta = nullptr);

/// The whole tensor `fqn` read from `dir` (one process; every chunk's
/// checksum verified). Throws CheckpointError naming the tensor or file.
torch::Tensor read_tensor(const std::string& dir, const Metadata& meta, const std::string& fqn);

}  // namespace cohort::dcp
