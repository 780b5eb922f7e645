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
  // Owned by `op`, which outlives a receive that timed out and stays
  // posted; plain memory, not tensors a caller's MemoryScope would count.
  auto& words = op->words();
  words.assign(static_cast<size_t>(2 * size * kSignatureWords), 0);
  int64_t* mine = words.data();
  int64_t* theirs = mine + size * kSignatureWords;
  fill_rows(s, send, size, mine);
  // Non-blocking, waited for here: a blocking call would hold MpiLock while
  // its peers wait, and another thread of this process (the algorithms'
  // executor checking a collective of its own engine) could then never
  // reach the peers' matching call. Point-to-point rather than one
  // MPI_Ialltoall: on a timeout, the receives still open name the peers
  // that did not call.
  MPI_Request* requests = op->requests(2 * (size - 1));
  int code = MPI_SUCCESS;
  {
    MpiLock lock;
    int i = 0;
    for (int q = 0; q < size && code == MPI_SUCCESS; ++q) {
      if (q == rank) continue;
      code = MPI_Irecv(theirs + q * kSignatureWords, kSignatureWords, MPI_INT64_T, q, kCheckTag,
                       comm, &requests[i]);
      if (code == MPI_SUCCESS) {
        code = MPI_Isend(mine + q * kSignatureWords, kSignatureWords, MPI_INT64_T, q, kCheckTag,
                         comm, &requests[size - 1 + i]);
      }
      ++i;
    }
  }
  if (code != MPI_SUCCESS) {
    return failed(std::make_exception_ptr(PeerError(op->what() + ": " + error_string(code))));
  }
  Watchdog::instance().watch(op);
  try {
    op->wait(timeout);
  } catch (const TimeoutError& e) {
    std::vector<int> silent;
    for (int i : op->unfinished()) {
      if (i < size - 1) silent.push_back(i < rank ? i : i + 1);  // a receive: its peer
    }
    if (silent.empty()) return failed(std::current_exception());
    return failed(std::make_exception_ptr(
        TimeoutError(std::string(e.what()) + "; " + silent_peers_message(silent, timeout))));
  } catch (const Error&) {
    return failed(std::current_exception());
  }
  const auto differs = compare_rows("mpi", s, recv, rank, size, theirs);
  if (differs.empty()) return nullptr;
  return failed(std::make_exception_ptr(MismatchError(differs)));
}

std::string liveness_probe(MPI_Comm comm, int rank, int size, int64_t seq, Millis most) {
  if (size <= 1) return "";
  // MPI may still hold the receives from a silent peer (and a send to it)
  // after this returns, and no request can be taken back from a stopped
  // process: the words live as long as the process (a few bytes, once per
  // communicator, which refuses further work after a timeout).
  auto* words = new int64_t[2 * static_cast<size_t>(size)]();
  std::vector<MPI_Request> recvs(static_cast<size_t>(size), MPI_REQUEST_NULL);
  std::vector<MPI_Request> sends(static_cast<size_t>(size), MPI_REQUEST_NULL);
  {
    MpiLock lock;
    for (int q = 0; q < size; ++q) {
      if (q == rank) continue;
      words[size + q] = seq;
      MPI_Irecv(&words[q], 1, MPI_INT64_T, q, kLivenessTag, comm, &recvs[q]);
      MPI_Isend(&words[size + q], 1, MPI_INT64_T, q, kLivenessTag, comm, &sends[q]);
    }
  }
  // Spun, not slept: MPI moves the words only inside MPI calls.
  const auto until = Clock::now() + most;
  std::vector<int> silent;
  while (true) {
    silent.clear();
    {
      MpiLock lock;
      for (int q = 0; q < size; ++q) {
        int flag = 1;
        if (recvs[q] != MPI_REQUEST_NULL) MPI_Test(&recvs[q], &flag, MPI_STATUS_IGNORE);
        if (!flag) silent.push_back(q);
        if (sends[q] != MPI_REQUEST_NULL) MPI_Test(&sends[q], &flag, MPI_STATUS_IGNORE);
      }
    }
    if (silent.empty()) return "; every peer still answers";
    if (Clock::now() >= until) break;
  }
  {
    MpiLock lock;
    for (auto* r : {&recvs, &sends}) {
      for (auto& q : *r) {
        if (q != MPI_REQUEST_NULL) MPI_Request_free(&q);
      }
    }
  }
  return "; " + silent_peers_message(silent, most, "waiting for this collective");
}

}  // namespace cohort::mpi
