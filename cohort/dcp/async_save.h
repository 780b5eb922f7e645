// defines: dcp::async_save and AsyncSave, a distributed checkpoint written
// while training goes on (after torch.distributed.checkpoint.async_save and
// its asynchronous staging):
//
//   auto pending = dcp::async_save(dcp::get_state_dict(model, opt), dir, comm);
//   ... forward and backward: they only read what is saved ...
//   pending.wait_staged();  // before anything changes it: the optimizer step
//   opt.step();
//   ...
//   pending.wait();  // every rank: the checkpoint is whole (or the error)
//
// Where each step runs, and why:
// - At the call, on the caller's thread: a save still pending on `comm` is
//   committed first (collective): its copy and write waited for, every
//   rank's outcome agreed, the chunk lists gathered on rank 0; rank 0's
//   making .metadata of them (parsing, the tiling check, the file and its
//   folder fsynced: milliseconds on a large model) is left to this save's
//   background thread. A save into the same folder writes it here
//   instead, since the folder must lose it before it changes. Then every
//   rank places its chunks in host staging memory, copies there at once the
//   tensors forward may change (the model's buffers: BatchNorm's running
//   statistics; tensors without a version counter) and records the version
//   counter of every other; the ranks agree on errors and check each
//   other's plans as save() does (one all-gather), and
//   only then rank 0 prepares the folder (the old .metadata and a killed
//   writer's temporary files removed), so that a save refused on any rank
//   leaves the checkpoint there whole.
//   The staging memory of the last save on the same communicator is reused
//   while a handle on that save lives (`pending = dcp::async_save(...)`
//   keeps it): fresh memory costs page faults several times the copy.
// - On a background thread: the last save's .metadata (rank 0), first, so
//   that a crash during this save's write leaves the last one whole; the
//   staging copy of the parameters and the optimizer state (what forward
//   and backward only read); then the checksums and the data file
//   (temporary file, fsync, rename). It uses no
//   communicator: a background thread issuing collectives while the training
//   issues its own on the same communicator would order them differently on
//   different ranks, a deadlock or messages silently matched to the wrong
//   operation.
// - At wait_staged() (not collective): the copy has finished; a saved
//   tensor whose version counter moved since the call (an in-place change:
//   an optimizer step, a load) fails the save, since its copy may be torn
//   or newer than the rest. The check runs on the caller's thread, so every
//   change the caller made before it counts, whatever the copy's timing.
// - At wait(), on the caller's thread (collective): wait_staged() if not
//   called yet, then every rank's outcome is agreed and rank 0 writes
//   .metadata, last and atomically. Until then the folder has no .metadata,
//   so a crash before the commit (a SIGKILL mid-write) leaves no checkpoint
//   there, and the checkpoints in other folders as they were. A save the
//   next one's call committed reports its .metadata write at the next
//   one's wait() (or its own wait(), which waits for that write), on every
//   rank.
#pragma once

#include <memory>
#include <string>

#include "cohort/core/types.h"
#include "cohort/dcp/dcp.h"

namespace cohort::dcp {

/// How long wait() waits for this rank's background write by default.
inline constexpr Millis kAsyncSaveTimeout{30 * 60 * 1000};

/// A save started by async_save. Copyable handle; every copy sees one save.
class AsyncSave {
 public:
  struct State;
  AsyncSave() = default;  ///< nothing pending: the waits return, staged() and ready() are true
  /// A handle on a save async_save started (not for users: async_save makes it).
  explicit AsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}

  /// Whether this rank's staging copy has finished (not collective).
  bool staged() const;

  /// Not collective: waits up to `timeout` for this rank's staging copy,
  /// then checks that no saved tensor changed since async_save (its version
  /// counter). Call it before changing what is saved (the optimizer step,
  /// a load into the model); wait() calls it too. A tensor changed before
  /// it does not throw here (the ranks would part ways): the save fails at
  /// wait(), on every rank, naming the tensor. Throws CheckpointError when
  /// the copy did not finish in time (and wait() fails too).
  void wait_staged(Millis timeout = kAsyncSaveTimeout);

  /// Whether this rank's background write has finished (not collective;
  /// the checkpoint exists only after wait()).
  bool ready() const;

  /// Collective over the save's communicator: wait_staged(), then waits up
  /// to `timeout` for this rank's write, then commits (rank 0 writes
  /// .metadata). Throws CheckpointError on every rank, naming
  /// dcp::async_save, the folder and the failing rank, when any rank's copy
  /// or write failed or timed out, or a saved tensor changed before
  /// wait_staged(); a second wait() returns at once, or rethrows that error.
  /// After the next save's call committed this one: waits up to `timeout`
  /// for the .metadata that save's thread writes and agrees on its outcome.
  /// Where the communicator was destroyed before, no rank can agree any
  /// more: throws CheckpointError saying so (an uncommitted save stays so).
  void wait(Millis timeout = kAsyncSaveTimeout);

 private:
  std::shared_ptr<State> state_;
};

/// Starts saving `state` into `dir` as save() does (collective over `comm`):
/// returns once this rank's chunks have their place in host staging memory
/// and the background copy has started; the caller must call wait_staged()
/// before it changes a saved tensor in place. The file is written in the
/// background and committed by wait(). A save still pending on `comm` is
/// committed first (its error thrown here; its .metadata written on this
/// save's thread before anything of this one), as save() does too: saves on
/// one communicator never overlap; load() waits for its staging and that
/// .metadata, and commits it first when it reads its folder. A handle
/// dropped without wait() is never committed (its thread is joined), nor is
/// a save whose communicator is destroyed before wait(): no later
/// communicator (one built at the same address included) commits or waits
/// for it.
[[nodiscard]] AsyncSave async_save(const StateDict& state, const std::string& dir,
                                   Communicator& comm);

}  // namespace cohort::dcp
