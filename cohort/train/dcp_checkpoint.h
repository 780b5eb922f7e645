// defines: the Trainer's glue to cohort/dcp: where a checkpoint's
// distributed part lives, the check that a resume makes before choosing it,
// the gradient sync's per-rank state as entries of the state dict, and the
// clean-up of parts whose checkpoint was rotated out.
//
// A checkpoint of step s is then two things in the checkpoint folder:
//   ckpt-<s>.cohort      rank 0's file (atomic, checksummed): the step,
//                        epoch and sample position, every rank's RNG state,
//                        and the flag saying the rest is in the folder below;
//   ckpt-<s>.cohort.dcp/ the model and optimizer state, and each rank's
//                        gradient-sync state, as a distributed checkpoint
//                        (dcp::save: one data file per rank and .metadata,
//                        written last).
// Rank 0 writes its file only after dcp::save returned on every rank, so a
// checkpoint that exists is whole; a crash in between leaves a folder
// without a file, which the next save removes.
#pragma once

#include <torch/nn/module.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>

#include "cohort/dcp/dcp.h"
#include "cohort/train/checkpoint_dir.h"

namespace cohort {

/// The distributed part of the checkpoint at `checkpoint_path`.
std::string dcp_folder(const std::string& checkpoint_path);

/// Throws CheckpointError naming the file when `folder` has no .metadata,
/// its .metadata does not verify, or a data file it lists is missing or has
/// another size (data checksums are verified by dcp::load).
void verify_dcp_folder(const std::string& folder);

/// The `whole` check of a CheckpointDir over `dir`: a checkpoint whose file
/// says its state is in its dcp folder needs that folder to verify
/// (verify_dcp_folder), for the rotation to count it and for a resume to
/// choose it.
CheckpointDir::Check dcp_folder_check(std::string dir);

/// Before loading (collective over `comm`): throws CheckpointError on every
/// rank, naming `folder` and a tensor, when the checkpoint `meta` holds a
/// model tensor that no rank's `state` asks for. dcp::load alone fills what
/// is asked and ignores the rest, as PyTorch's does; a resume must not
/// quietly continue a larger model's training with part of its weights.
void check_state_covers_model(const dcp::Metadata& meta, const dcp::StateDict& state,
                              Communicator& comm, const std::string& folder);

/// For saving: `model`'s buffers (BatchNorm statistics, which each rank
/// updates from its own batch) are saved from rank 0, not from whichever
/// rank dcp picks: what a resume at another world size gives every rank.
void save_buffers_from_rank0(dcp::StateDict& state, torch::nn::Module& model, int rank);

/// For saving under a plan that does not broadcast buffers
/// (TrainingPlan::broadcasts_buffers): copies of rank `rank`'s buffers of
/// `model` as tensors of its own, "buffers.rank<rank>.<name>", which only
/// this rank holds and writes.
void add_rank_buffers(dcp::StateDict& state, const torch::nn::Module& model, int rank);

/// For loading at the world size that wrote them: a target for each buffer
/// of `model` whose "buffers.rank<rank>." copy `meta` holds with the same
/// shape and dtype, and an after_load step that copies them into the
/// buffers, over the model's entries (rank 0's) loaded before it.
void add_rank_buffer_targets(dcp::StateDict& state, const dcp::Metadata& meta,
                             torch::nn::Module& model, int rank);

/// Adds rank `rank`'s gradient-sync state (a compressor's error feedback)
/// to `state` as tensors of its own, "sync.rank<rank>.<name>", which only
/// this rank holds and writes (copies: the sync may change its tensors
/// while an async save writes them).
void add_sync_state(dcp::StateDict& state, const std::map<std::string, torch::Tensor>& sync,
                    int rank);

/// For loading: adds to `state` a target for each of rank `rank`'s
/// "sync.rank<rank>." tensors in `meta`, a check_before_load step that hands
/// their staged values to `check` (a throw refuses the load on every rank,
/// with nothing loaded), and an after_load step that hands them, named as
/// add_sync_state got them, to `install` (empty when the checkpoint holds
/// none).
void add_sync_targets(dcp::StateDict& state, const dcp::Metadata& meta, int rank,
                      std::function<void(const std::map<std::string, torch::Tensor>&)> check,
                      std::function<void(const std::map<std::string, torch::Tensor>&)> install);

/// True when `meta` holds some rank's gradient-sync state.
bool holds_sync_state(const dcp::Metadata& meta);

/// Removes the dcp folders in `dir` whose checkpoint file is gone, except
/// that of `keep_step` (being written).
void remove_orphan_dcp_folders(const CheckpointDir& dir, int64_t keep_step);

}  // namespace cohort
