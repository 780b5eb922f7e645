#include "cohort/comm/mpi/op.h"

#include "cohort/comm/mpi/runtime.h"
#include "cohort/comm/mpi/watchdog.h"
#include "cohort/core/error.h"
#include "cohort/core/tensor_checks.h"

namespace cohort::mpi {

std::string OpName::str() const {
  if (!group) return detail;
  return std::string(call) + detail + ") on rank " + std::to_string(rank) + " of " +
         std::to_string(size) + " (" + *group + ")";
}

MpiOp::MpiOp(OpName name, Millis timeout)
    : name_(std::move(name)),
      timeout_(timeout),
      abort_at_(
          (Clock::now() + timeout + Watchdog::instance().grace()).time_since_epoch().count()) {}

namespace {
OpName sentence(std::string what) {
  OpName n;
  n.detail = std::move(what);  // no group: str() is the sentence alone
  return n;
}
}  // namespace

MpiOp::MpiOp(std::string what, Millis timeout) : MpiOp(sentence(std::move(what)), timeout) {}

MPI_Request* MpiOp::requests(int count) {
  requests_.assign(static_cast<size_t>(count), MPI_REQUEST_NULL);
  return requests_.data();
}

bool MpiOp::test_locked() {
  if (finished()) return true;
  if (requests_.empty()) return false;  // a blocking call: mark_finished() ends it
  int flag = 0;
  int code;
  std::vector<MPI_Status> statuses(expected_bytes_ >= 0 ? requests_.size() : 0);
  {
    MpiLock lock;
    code = MPI_Testall(static_cast<int>(requests_.size()), requests_.data(), &flag,
                       statuses.empty() ? MPI_STATUSES_IGNORE : statuses.data());
  }
  if (!statuses.empty() && (code != MPI_SUCCESS || flag)) {
    error_ = bad_message(statuses[0], code);
    mismatch_ = !error_.empty();
  }
  if (error_.empty() && code != MPI_SUCCESS) {
    error_ = what() + ": " + error_string(code);
  } else if (code == MPI_SUCCESS && !flag) {
    return false;
  }
  // MPI is done with the buffers (or failed): they may go.
  tensors_.clear();
  finished_.store(true, std::memory_order_release);
  return true;
}

std::string MpiOp::bad_message(const MPI_Status& status, int code) const {
  int error_class = MPI_SUCCESS;
  MPI_Count got = 0;
  {
    MpiLock lock;
    // Open MPI reports a truncation as MPI_ERR_IN_STATUS from MPI_Testall,
    // the status holding MPI_ERR_TRUNCATE.
    MPI_Error_class(code == MPI_ERR_IN_STATUS ? status.MPI_ERROR : code, &error_class);
    MPI_Get_elements_x(&status, MPI_BYTE, &got);
  }
  const std::string buffer = "the receive buffer (" + std::to_string(expected_bytes_) + " bytes, " +
                             dtype_name(expected_dtype_) + ")";
  const std::string why = ": the ranks called different operations or sizes";
  if (code != MPI_SUCCESS) {
    if (error_class != MPI_ERR_TRUNCATE) return "";
    // MPI fills the buffer and reports its size, not the message's.
    return what() + ": the message is larger than " + buffer + " (MPI_ERR_TRUNCATE)" + why;
  }
  if (got == expected_bytes_) return "";
  return what() + ": the message (" + std::to_string(got) + " bytes) is " +
         (got > expected_bytes_ ? "larger" : "shorter") + " than " + buffer + why;
}

bool MpiOp::test() {
  std::lock_guard<std::mutex> lock(mu_);
  return test_locked();
}

bool MpiOp::try_test() {
  std::unique_lock<std::mutex> lock(mu_, std::try_to_lock);
  return lock.owns_lock() ? test_locked() : finished();
}

std::vector<int> MpiOp::unfinished() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int> left;
  if (finished()) return left;
  MpiLock mpi;
  for (size_t i = 0; i < requests_.size(); ++i) {
    int flag = 1;
    // A finished request becomes MPI_REQUEST_NULL, which MPI_Testall takes
    // as finished later.
    if (requests_[i] != MPI_REQUEST_NULL) MPI_Test(&requests_[i], &flag, MPI_STATUS_IGNORE);
    if (!flag) left.push_back(static_cast<int>(i));
  }
  return left;
}

void MpiOp::mark_finished() {
  std::lock_guard<std::mutex> lock(mu_);
  finished_.store(true, std::memory_order_release);
}

Clock::time_point MpiOp::abort_at() const {
  return Clock::time_point(Clock::duration(abort_at_.load(std::memory_order_relaxed)));
}

void MpiOp::wait(Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto start = Clock::now();
  // A waiter with a longer timeout than the communicator's keeps the
  // watchdog off for that long.
  const auto waiter_abort =
      (start + timeout + Watchdog::instance().grace()).time_since_epoch().count();
  auto current = abort_at_.load(std::memory_order_relaxed);
  while (waiter_abort > current &&
         !abort_at_.compare_exchange_weak(current, waiter_abort, std::memory_order_relaxed)) {
  }
  // Spin on MPI_Testall as MPI_Wait itself would: MPI makes progress on
  // non-blocking collectives only inside MPI calls, and sleeping here would
  // stall them (Open MPI yields inside its progress loop when oversubscribed).
  const auto deadline = start + timeout;
  while (!test_locked()) {
    if (Clock::now() >= deadline) {
      throw TimeoutError(what() + " did not complete within " + std::to_string(timeout.count()) +
                         " ms (a rank that never joined, or a mismatched call); unless it "
                         "finishes, the MPI watchdog aborts the job " +
                         std::to_string(Watchdog::instance().grace().count()) + " ms later");
    }
  }
  if (mismatch_) throw MismatchError(error_);
  if (!error_.empty()) throw PeerError(error_);
}

// MPI_Comm_dup of `comm`, watched (it is collective and blocking); `what`
// names it for the watchdog and errors. Throws PeerError when MPI fails.
MPI_Comm watched_comm_dup(MPI_Comm comm, const std::string& what, Millis timeout) {
  auto o = std::make_shared<MpiOp>(what, timeout);
  Watchdog::instance().watch(o);
  MPI_Comm dup = MPI_COMM_NULL;
  int code;
  {
    MpiLock lock;
    code = MPI_Comm_dup(comm, &dup);
  }
  o->mark_finished();
  mpi_check(code, o->what());
  MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN);
  return dup;
}

}  // namespace cohort::mpi
