#include "cohort/comm/mpi/runtime.h"

#include <cstdlib>

#include "cohort/comm/mpi/watchdog.h"
#include "cohort/core/error.h"

namespace cohort::mpi {
namespace {

std::mutex g_init_mu;
bool g_ready = false;
int g_thread_level = MPI_THREAD_SINGLE;
// Only serializes when MPI lacks MPI_THREAD_MULTIPLE.
std::mutex g_call_mu;
bool g_serialize = true;

// Registered with atexit, so it runs before static destructors: MPI ends
// while the watchdog still guards a Finalize stuck behind a lost peer.
void finalize_at_exit() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
  Watchdog::instance().stop();
}

void stop_watchdog_at_exit() { Watchdog::instance().stop(); }

}  // namespace

void ensure_mpi() {
  std::lock_guard<std::mutex> lock(g_init_mu);
  if (g_ready) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) throw ConfigError("mpi: MPI_Finalize was already called in this process");
  int initialized = 0;
  MPI_Initialized(&initialized);
  if (initialized) {
    // The application owns MPI: it initialized it and will finalize it.
    MPI_Query_thread(&g_thread_level);
    std::atexit(stop_watchdog_at_exit);
  } else {
    // Open MPI's libnbc picks a binomial MPI_Iallreduce for in-place buffers
    // at small worlds, which sends everything through one root: at world 2
    // we measured 0.3-0.6x the busbw of blocking MPI_Allreduce from 64 KiB
    // to 16 MiB, and ~0.9x with its ring. Only when cohort owns MPI_Init and
    // the user chose nothing.
    setenv("OMPI_MCA_coll_libnbc_iallreduce_algorithm", "1", /*overwrite=*/0);
    // SERIALIZED, not MULTIPLE: MpiLock already serializes cohort's calls, and
    // Open MPI skips its internal locking below MULTIPLE.
    const int code = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SERIALIZED, &g_thread_level);
    if (code != MPI_SUCCESS)
      throw ConfigError("mpi: MPI_Init_thread failed: " + error_string(code));
    std::atexit(finalize_at_exit);
  }
  g_serialize = g_thread_level < MPI_THREAD_MULTIPLE;
  Watchdog::instance();  // starts its thread
  g_ready = true;
}

int thread_level() { return g_thread_level; }

MpiLock::MpiLock() : mu_(g_serialize ? &g_call_mu : nullptr) {
  if (mu_) mu_->lock();
}

MpiLock::~MpiLock() {
  if (mu_) mu_->unlock();
}

std::string error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<size_t>(len));
}

void mpi_check(int code, const std::string& what) {
  if (code != MPI_SUCCESS) throw PeerError(what + ": " + error_string(code));
}

}  // namespace cohort::mpi
