// defines: the process-wide MPI state cohort relies on: ensure_mpi()
// (MPI_Init_thread once, MPI_Finalize at exit only if cohort initialized),
// MpiLock (serializes cohort's MPI calls unless MPI grants
// MPI_THREAD_MULTIPLE), mpi_check() (an MPI return code to an exception).
//
// Only files in cohort/comm/mpi/ include <mpi.h>; the rest of cohort sees
// MPI through engine_registry.h and launch.h.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <mpi.h>

#include <mutex>
#include <string>

namespace cohort::mpi {

// Initializes MPI (asking for MPI_THREAD_SERIALIZED: MpiLock does the
// serializing) unless the application already did, and starts the watchdog. Idempotent and
// thread-safe. Throws ConfigError when MPI was finalized already.
void ensure_mpi();

// The thread level MPI granted (MPI_THREAD_SINGLE ... MPI_THREAD_MULTIPLE).
int thread_level();

// Held around every MPI call cohort makes. A no-op under
// MPI_THREAD_MULTIPLE; a process-wide mutex otherwise, which makes cohort
// correct under MPI_THREAD_SERIALIZED too.
class MpiLock {
 public:
  MpiLock();
  ~MpiLock();
  MpiLock(const MpiLock&) = delete;
  MpiLock& operator=(const MpiLock&) = delete;

 private:
  std::mutex* mu_;
};

// MPI's text for an error code: "MPI_ERR_TRUNCATE: message truncated".
std::string error_string(int code);

// Throws PeerError("<what>: <MPI's message>") unless code == MPI_SUCCESS.
void mpi_check(int code, const std::string& what);

}  // namespace cohort::mpi
