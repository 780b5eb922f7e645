// defines: dcp::async_save and AsyncSave, a distributed checkpoint written
// while training goes on (after torch.distributed.checkpoint.async_save):
//
//   auto pending = dcp::async_save(dcp::get_state_dict(model, opt), dir, comm);
//   ... train: the model may change as soon as async_save returns ...
//   pending.wait();  // every rank: the checkpoint is whole (or the error)
//
// Where each step runs, and why:
// - At the call, on the caller's thread: a save still pending on `comm` is
//   finished first (collective); rank 0 prepares the folder (the old
//   .metadata and a killed writer's temporary files removed); every rank
//   copies its chunks into host staging memory; the ranks agree on errors
//   (an all-gather). This is the pause the training sees. The staging
//   memory of the last save on the same communicator is reused while a
//   handle on that save lives (`pending = dcp::async_save(...)` keeps it):
//   fresh memory costs page faults several times the copy itself.
// - On a writer thread: the checksums and the data file (temporary file,
//   fsync, rename). It uses no communicator: a background thread issuing
//   collectives while the training issues its own on the same communicator
//   would order them differently on different ranks, a deadlock or messages
//   silently matched to the wrong operation.
// - At wait(), on the caller's thread (collective): every rank's write
//   outcome is agreed and rank 0 writes .metadata, last and atomically.
//   Until then the folder has no .metadata, so a crash before the commit
//   (a SIGKILL mid-write) leaves no checkpoint there, and the checkpoints in
//   other folders as they were.
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
  AsyncSave() = default;  ///< nothing pending: wait() returns, ready() is true
  /// A handle on a save async_save started (not for users: async_save makes it).
  explicit AsyncSave(std::shared_ptr<State> state) : state_(std::move(state)) {}

  /// Whether this rank's background write has finished (not collective;
  /// the checkpoint exists only after wait()).
  bool ready() const;

  /// Collective over the save's communicator: waits up to `timeout` for this
  /// rank's write, then commits (rank 0 writes .metadata). Throws
  /// CheckpointError on every rank, naming dcp::async_save, the folder and
  /// the failing rank, when any rank's write failed or timed out; a second
  /// wait() returns at once, or rethrows that error.
  void wait(Millis timeout = kAsyncSaveTimeout);

 private:
  std::shared_ptr<State> state_;
};

/// Starts saving `state` into `dir` as save() does (collective over `comm`):
/// returns once this rank's chunks are copied to host staging memory; the
/// file is written in the background and committed by wait(). A save still
/// pending on `comm` is finished first (its error thrown here), as save()
/// does too: saves on one communicator never overlap. A handle dropped
/// without wait() is never committed (its writer is joined).
AsyncSave async_save(const StateDict& state, const std::string& dir, Communicator& comm);

}  // namespace cohort::dcp
