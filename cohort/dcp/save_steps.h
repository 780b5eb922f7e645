// defines: the steps of a save that dcp::save runs in a row and
// dcp::async_save splits between the caller's thread (collectives, the
// staging copy) and its writer thread (checksums, the file). Internal to dcp.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "cohort/dcp/collective_status.h"
#include "cohort/dcp/dcp.h"

namespace cohort::dcp {

/// The bytes this rank writes and their chunk list, before checksums.
struct StagedFile {
  nlohmann::json tensors;           ///< per tensor: fqn, shape, dtype, chunks (no crc32 yet)
  std::vector<torch::Tensor> data;  ///< every chunk's values, contiguous, in file order
  std::vector<std::string> modules;
  int64_t bytes = 0;
  /// With an arena: what each chunk of `data` is to be copied from (not yet
  /// copied; as the state dict holds it, not detached), and the fqn of its
  /// tensor.
  std::vector<torch::Tensor> sources;
  std::vector<std::string> source_fqns;
  /// plan_of(the state dict, this), for agree_on_plan.
  std::string plan;
};

/// Every tensor of `state` (written or not): its name, global shape, dtype,
/// replicated and write flags, and the boxes `staged` writes of it (JSON).
std::string plan_of(const StateDict& state, const StagedFile& staged);

/// Collective, before the folder is touched: all-gathers every rank's
/// `error` (with its `kind`) or, where it is "", its `plan`. Throws as
/// agree() when any rank failed; else every rank checks every rank's plan as
/// rank 0's merge would (one shape, dtype and layout per tensor, no tensor
/// twice on a rank, the same replicated tensors in the same order on every
/// rank, boxes that tile each written tensor) and throws the same
/// InvalidArgument, named `op`, naming the tensor and the ranks.
void agree_on_plan(Communicator& comm, const std::string& plan, const std::string& error,
                   ErrorKind kind, const std::string& op);

/// This rank's chunks of `state`; with `arena`, places for them in it, which
/// the caller fills from `sources` (so that the caller may change the model
/// afterwards): `*arena` is reused when it is large enough and nothing else
/// holds it, else replaced by a new one; without, views where the data is
/// contiguous already. Throws InvalidArgument (named `op`) for a shard that
/// does not fit its box (check_shards).
StagedFile stage_rank_file(const StateDict& state, int rank, int world, torch::Tensor* arena,
                           const std::string& op);

/// Checksums and writes `staged` as this rank's file (atomic); returns its
/// chunk list (JSON) for commit(). Touches no communicator.
std::string write_staged_file(StagedFile& staged, const std::string& dir, int rank);

/// Rank 0, before any rank writes: makes `dir`, removes a killed writer's
/// temporary files and the old .metadata. Returns the error text ("" if none).
std::string prepare_folder(const std::string& dir);

/// Collective: agrees on every rank's `error` (agree(): an error of `kind`,
/// or of the lowest failing rank's kind, on every rank when any rank
/// failed), then gathers every rank's chunk list on rank
/// 0 (the others get none).
std::vector<std::string> gather_lists(Communicator& comm, const std::string& list,
                                      const std::string& error,
                                      ErrorKind kind = ErrorKind::Checkpoint);

/// Rank 0: merges the chunk lists, checks that they tile every tensor, and
/// writes them as .metadata of `dir` (atomically). Throws InvalidArgument or
/// Error; touches no communicator.
void write_metadata_file(const std::vector<std::string>& lists, const std::string& dir);

/// Collective: rank 0 runs write_metadata_file; every rank throws
/// CheckpointError when it failed.
void write_metadata(Communicator& comm, const std::string& dir,
                    const std::vector<std::string>& lists);

/// Collective: gather_lists, then write_metadata (.metadata last). Throws
/// on every rank when any rank failed (as gather_lists).
void commit(Communicator& comm, const std::string& dir, const std::string& list,
            const std::string& error, ErrorKind kind = ErrorKind::Checkpoint);

/// Waits until the async save pending on `comm` (if any) has copied its
/// staging data, so that the caller may change the tensors it saves
/// (AsyncSave::wait_staged); collective when that save writes the .metadata
/// of the one before it: that write's outcome is agreed, so that every rank
/// may read the folder. Returns this rank's error ("" if none) when the copy
/// did not finish in time, for the caller to agree on: nothing may change
/// the saved tensors then.
std::string wait_pending_staging(Communicator& comm);

/// Collective: waits for and commits the async save still pending on `comm`
/// (none: returns), so that saves on one communicator never overlap.
void finish_pending_save(Communicator& comm);

/// Collective: the same where the save pending on `comm` writes into `dir`
/// (under any path), so that a load of that folder finds the checkpoint
/// whole rather than no .metadata.
void finish_pending_save_into(Communicator& comm, const std::string& dir);

}  // namespace cohort::dcp
