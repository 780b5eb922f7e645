// defines: init() and the default group (world()), connect() for explicit
// communicators (ranks as threads in tests, embedding applications),
// InitOptions and ConnectOptions.
//
// init() does what torchrun users expect: RANK, WORLD_SIZE and
// MASTER_ADDR/MASTER_PORT from the environment (cohortrun and torchrun set
// them), a TcpStore hosted by rank 0, and a Gloo group over it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "cohort/comm/communicator.h"
#include "cohort/comm/gloo/gloo_options.h"
#include "cohort/core/store/store.h"

namespace cohort {

/// What connect() builds: the communicator's options, plus the engine and
/// where its transport listens. connect() reads no environment.
struct ConnectOptions : CommunicatorOptions {
  /// "gloo" (connect()'s default; init()'s is "auto"), "mpi" in a build with MPI (COHORT_WITH_MPI),
  /// "ucx" in a build with UCX (COHORT_WITH_UCX; it listens where `gloo` says).
  std::string backend = "gloo";
  /// Gloo binds loopback unless the ranks span several hosts.
  GlooOptions gloo;
};

/// Builds a communicator of `world_size` ranks over `store`; every rank calls it.
std::shared_ptr<Communicator> connect(std::shared_ptr<Store> store, int rank, int world_size,
                                      const ConnectOptions& options = {});

/// What init() reads from the environment unless set here.
struct InitOptions {
  /// Empty: COHORT_BACKEND, else "mpi" when started by mpirun (or after the
  /// application's MPI_Init) in a build with MPI, else "auto": "ucx" when built, else
  /// "gloo" (COHORT_DEBUG=detail prints the choice and why).
  std::string backend;
  /// "env://" (default: MASTER_ADDR/MASTER_PORT), "tcp://HOST:PORT" or
  /// "file:///path/to/shared/file".
  std::string init_method = "env://";
  /// Negative: RANK / WORLD_SIZE from the environment.
  int rank = -1;
  /// Negative: WORLD_SIZE from the environment.
  int world_size = -1;
  /// Unset: COHORT_TIMEOUT (seconds), else 30 minutes as in PyTorch.
  std::optional<Millis> timeout;
  /// Unset: COHORT_DEBUG=detail turns the checks on.
  std::optional<bool> debug_checks;
  /// Unset: COHORT_ALGO, else Engine.
  std::optional<Algorithm> algorithm;
  /// Unset: COHORT_TRACE (a folder: each rank writes its timeline there as
  /// `rank-R.json`, R the rank), else no trace. Empty: no trace.
  std::optional<std::string> trace_dir;
};

/// Sets up the default group and returns it. Throws ConfigError for a bad
/// environment, TimeoutError when the rendezvous does not complete.
std::shared_ptr<Communicator> init(const InitOptions& options = {});
bool is_initialized();
/// This process's rank among the ranks of its node, as its launcher says
/// (for picking its GPU): LOCAL_RANK (cohortrun, torchrun), else
/// OMPI_COMM_WORLD_LOCAL_RANK (mpirun), else SLURM_LOCALID in a Slurm job
/// step that init() takes the world from (srun, a task per rank), else 0.
/// Throws ConfigError naming a malformed variable. Needs no init().
int local_rank();
/// The default group; throws if init() was not called.
Communicator& world();
std::shared_ptr<Communicator> world_ptr();
/// Drops the default group (collective: call it on every rank). Rank 0
/// closes the group's store, and the other ranks return once it has, so
/// that init() can be called again at once. Throws TimeoutError when rank 0
/// does not finalize within the group's timeout.
void finalize();

}  // namespace cohort
