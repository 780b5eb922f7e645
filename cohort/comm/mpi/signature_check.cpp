#include "cohort/comm/mpi/signature_check.h"

#include "cohort/comm/mpi/runtime.h"
#include "cohort/comm/mpi/watchdog.h"
#include "cohort/core/error.h"
#include "cohort/core/job_work.h"

namespace cohort::mpi {
namespace {

WorkPtr failed(std::exception_ptr error) {
  auto w = std::make_shared<JobWork>("mpi signature check");
  w->finish(std::move(error));
  return w;
}

}  // namespace

WorkPtr check_signature(MPI_Comm comm, int rank, int size, const Signature& s,
                        const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                        const std::shared_ptr<MpiOp>& op, Millis timeout) {
  std::vector<int64_t> mine(static_cast<size_t>(size * kSignatureWords));
  std::vector<int64_t> theirs(mine.size());
  fill_rows(s, send, size, mine.data());
  // Non-blocking, waited for here: a blocking call would hold MpiLock while
  // its peers wait, and another thread of this process (the algorithms'
  // executor checking a collective of its own engine) could then never
  // reach the peers' matching call.
  int code;
  {
    MpiLock lock;
    code = MPI_Ialltoall(mine.data(), kSignatureWords, MPI_INT64_T, theirs.data(), kSignatureWords,
                         MPI_INT64_T, comm, op->requests(1));
  }
  if (code != MPI_SUCCESS) {
    return failed(std::make_exception_ptr(PeerError(op->what() + ": " + error_string(code))));
  }
  Watchdog::instance().watch(op);
  try {
    op->wait(timeout);
  } catch (const Error&) {
    return failed(std::current_exception());
  }
  const auto differs = compare_rows("mpi", s, recv, rank, size, theirs.data());
  if (differs.empty()) return nullptr;
  return failed(std::make_exception_ptr(MismatchError(differs)));
}

}  // namespace cohort::mpi
