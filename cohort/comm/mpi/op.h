// defines: MpiOp (one MPI operation in flight: its requests, the buffers MPI
// uses until it finishes, its deadline) and MpiWork (the WorkImpl over it).
//
// Progress model: the thread that waits drives MPI. Operations are started
// with non-blocking calls (MPI_Iallreduce, MPI_Isend, ...) on the caller's
// thread, and wait() polls MPI_Testall until they finish or the timeout
// passes, so a timeout is a TimeoutError, never a hang. See mpi_engine.cpp
// for why this beats a progress thread here.
#pragma once

#define OMPI_SKIP_MPICXX 1
#include <ATen/ATen.h>
#include <mpi.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cohort/core/error.h"
#include "cohort/core/types.h"
#include "cohort/core/work.h"

namespace cohort::mpi {

using Clock = std::chrono::steady_clock;

// What an operation is called in messages: "MPI_Ibcast (broadcast, root 1)
// on rank 0 of 2 (MPI_COMM_WORLD)". Kept in pieces and joined only when a
// message needs it: building the string cost a visible share of a 1 KiB
// all_reduce.
struct OpName {
  const char* call = "";  // "MPI_Ibcast (broadcast"
  std::string detail;     // ", root 1"; usually empty
  int rank = 0;
  int size = 1;
  std::shared_ptr<const std::string> group;  // the engine's label

  std::string str() const;
};

class MpiOp {
 public:
  // The watchdog ends the job when the operation is not finished `timeout`
  // plus its grace from now, or from the start of a wait() with a longer
  // timeout.
  MpiOp(OpName name, Millis timeout);
  // For blocking calls, named by a whole sentence.
  MpiOp(std::string what, Millis timeout);

  // The requests to fill by the MPI_I* calls; call before starting.
  MPI_Request* requests(int count);
  // Buffers and arrays that must outlive the operation.
  void keep(at::Tensor t) { tensors_.push_back(std::move(t)); }
  std::vector<int>& ints() { return ints_; }
  std::vector<int64_t>& words() { return words_; }
  // For a receive into `bytes` bytes of `dtype` (the caller's): a message
  // of another size is a MismatchError naming both sizes (MPI accepts a
  // shorter one silently and reports a longer one as MPI_ERR_TRUNCATE).
  // The cost: the receive's status, one MPI_Get_elements_x and a compare.
  // MPI does not carry the sender's dtype: a message of another dtype with
  // the same bytes is beyond what MPI can see without a header per message.
  void expect_message(int64_t bytes, at::ScalarType dtype) {
    expected_bytes_ = bytes;
    expected_dtype_ = dtype;
  }

  // Tests once; true when finished (successfully or not).
  bool test();
  // Like test(), but returns false at once if another thread is inside
  // test() or wait() (the watchdog must never block on a waiter).
  bool try_test();
  // Polls until finished; throws TimeoutError after `timeout`, PeerError
  // with MPI's message when MPI reports an error, MismatchError for a
  // receive's message of another size (expect_message).
  void wait(Millis timeout);
  // The indices (in the order of requests()) of the requests still
  // unfinished; tests each once.
  std::vector<int> unfinished();
  // For blocking MPI calls, which have no request: marks the end.
  void mark_finished();

  bool finished() const { return finished_.load(std::memory_order_acquire); }
  Clock::time_point abort_at() const;
  std::string what() const { return name_.str(); }
  Millis timeout() const { return timeout_; }

 private:
  bool test_locked();

  const OpName name_;
  const Millis timeout_;
  std::mutex mu_;  // one thread tests the requests at a time (MPI forbids more)
  std::vector<MPI_Request> requests_;
  std::vector<at::Tensor> tensors_;
  std::vector<int> ints_;
  std::vector<int64_t> words_;
  // A receive's message check: what a message that fits has; the
  // caller's dtype, named in the error.
  int64_t expected_bytes_ = -1;
  at::ScalarType expected_dtype_ = at::kByte;
  // The receive's message had another size than its buffer (its status).
  std::string bad_message(const MPI_Status& status, int code) const;
  std::string error_;
  bool mismatch_ = false;  // error_ is a MismatchError's
  std::atomic<bool> finished_{false};
  std::atomic<Clock::rep> abort_at_;
};

// What a collective whose wait timed out asks its peers before it reports
// (liveness_probe in signature_check.h): text appended to the TimeoutError.
using Probe = std::function<std::string(Millis waited)>;

class MpiWork : public WorkImpl {
 public:
  explicit MpiWork(std::shared_ptr<MpiOp> op, Probe probe = {})
      : op_(std::move(op)), probe_(std::move(probe)) {}
  bool is_completed() override { return op_->test(); }
  void wait(Millis timeout) override {
    try {
      op_->wait(timeout);
    } catch (const TimeoutError& e) {
      if (!probe_) throw;
      throw TimeoutError(e.what() + probe_(timeout));
    }
  }

 private:
  std::shared_ptr<MpiOp> op_;
  Probe probe_;
};

// MPI_Comm_dup of `comm`, watched (it is collective and blocking); `what`
// names it for the watchdog and errors. Throws PeerError when MPI fails.
// The copy returns errors rather than aborting (MPI_ERRORS_RETURN).
MPI_Comm watched_comm_dup(MPI_Comm comm, const std::string& what, Millis timeout);

}  // namespace cohort::mpi
