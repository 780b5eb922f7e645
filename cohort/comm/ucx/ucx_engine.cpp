// The UCX engine: point-to-point on UCX's tag matching, collectives over it
// (collectives.h) run by the engine's thread, or inline when small and the
// thread is idle. See README.md for the progress rule.
#include "cohort/comm/ucx/ucx_engine.h"

#include <algorithm>
#include <functional>
#include <optional>

#include "cohort/comm/ucx/collectives.h"
#include "cohort/comm/ucx/worker.h"
#include "cohort/core/env.h"
#include "cohort/core/error.h"
#include "cohort/core/job_work.h"
#include "cohort/core/serial_worker.h"
#include "cohort/core/signature.h"
#include "cohort/core/work_then.h"

namespace cohort::ucx {
namespace {

// Collectives up to this size run on the caller's thread when nothing is
// queued: the hand-off to the engine's thread costs more than they do.
// Measured (world 2, float32 sum, direct exchange, medians of 5 alternated
// runs): 1 MiB took 117 us inline against 140 us on the engine's thread
// (plain MPI_Allreduce 128 us). Larger ones go to the engine's thread, so
// an asynchronous caller (DDP's 25 MB buckets) computes meanwhile.
int64_t inline_bytes() {
  static const int64_t n = env::get_int("COHORT_UCX_INLINE_BYTES", 0, 1 << 30).value_or(1 << 20);
  return n;
}

// The point-to-point the algorithms see: send and recv on the collective
// channel, so the engine's collective messages never meet the user's tags.
class CollectiveChannel : public PointToPoint {
 public:
  explicit CollectiveChannel(std::shared_ptr<Worker> w) : w_(std::move(w)) {}
  int rank() const override { return w_->rank(); }
  int size() const override { return w_->size(); }
  WorkPtr send(at::Tensor& t, int dst, int tag) override {
    return std::make_shared<TransferWork>(w_, w_->post(Channel::Collective, t, dst, tag, true));
  }
  WorkPtr recv(at::Tensor& t, int src, int tag) override {
    return std::make_shared<TransferWork>(w_, w_->post(Channel::Collective, t, src, tag, false));
  }

 private:
  std::shared_ptr<Worker> w_;
};

class UcxEngine : public Engine {
 public:
  UcxEngine(std::shared_ptr<Worker> worker, std::string bind_address, std::string interface,
            Millis timeout)
      : worker_(std::move(worker)),
        channel_(worker_),
        bind_address_(std::move(bind_address)),
        interface_(std::move(interface)),
        timeout_(timeout),
        serial_(serial_options(*worker_)) {}

  std::string name() const override { return "ucx"; }
  bool propagates_nan() const override { return true; }  // min_of, max_of (collectives.cpp)
  int rank() const override { return worker_->rank(); }
  int size() const override { return worker_->size(); }

  // Each message's tag carries the caller's dtype, checked by the receive
  // (transfer.h): a message of another dtype is a MismatchError, never
  // bytes read as another type.
  WorkPtr send(at::Tensor& t, int dst, int tag) override {
    const int dtype = static_cast<int>(caller_dtype_or(t.scalar_type()));
    return std::make_shared<TransferWork>(worker_,
                                          worker_->post(Channel::User, t, dst, tag, true, dtype));
  }
  WorkPtr recv(at::Tensor& t, int src, int tag) override {
    const int dtype = static_cast<int>(caller_dtype_or(t.scalar_type()));
    return std::make_shared<TransferWork>(worker_,
                                          worker_->post(Channel::User, t, src, tag, false, dtype));
  }

  WorkPtr all_reduce(at::Tensor& t, ReduceOp op) override {
    const auto d = given_or(Kind::AllReduce, t, -1, op);
    const int p = size();
    if (p > 1 && (p & (p - 1)) == 0 &&
        static_cast<int64_t>(t.nbytes()) <=
            (p == 2 ? kDirectExchangeBytes : kRecursiveDoublingBytes) &&
        small_all_reduce_handles(t.scalar_type())) {
      // At world 2 the one message each way is also the collective's check
      // (kDirectExchangeBytes fits the fused tag's count field).
      const auto fused = p == 2 ? fused_tag(d) : std::nullopt;
      return submit(
          "ucx all_reduce", t.nbytes(), d,
          [this, t, op, fused](Link& l) mutable {
            auto& tmp = small_tmp(t);
            small_all_reduce(*worker_, t, tmp.exact, tmp.full, op, l.deadline(), fused.value_or(0));
          },
          fused.has_value());
    }
    return submit("ucx all_reduce", t.nbytes(), d,
                  [t, op](Link& l) mutable { ucx::all_reduce(l, t, op); });
  }
  WorkPtr broadcast(at::Tensor& t, int root) override {
    return submit("ucx broadcast", t.nbytes(), given_or(Kind::Broadcast, t, root),
                  [t, root](Link& l) mutable { ucx::broadcast(l, t, root); });
  }
  WorkPtr reduce(at::Tensor& t, int root, ReduceOp op) override {
    return submit("ucx reduce", t.nbytes(), given_or(Kind::Reduce, t, root, op),
                  [t, root, op](Link& l) mutable { ucx::reduce(l, t, root, op); });
  }
  WorkPtr all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override {
    return submit("ucx all_gather", input.nbytes() * outputs.size(),
                  given_or(Kind::AllGather, input),
                  [outputs, input](Link& l) mutable { ucx::all_gather(l, outputs, input); });
  }
  WorkPtr gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) override {
    return submit(
        "ucx gather", input.nbytes(), given_or(Kind::Gather, input, root),
        [outputs, input, root](Link& l) mutable { ucx::gather(l, outputs, input, root); });
  }
  WorkPtr scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) override {
    return submit(
        "ucx scatter", output.nbytes(), given_or(Kind::Scatter, output, root),
        [output, inputs, root](Link& l) mutable { ucx::scatter(l, output, inputs, root); });
  }
  WorkPtr all_to_all(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_counts,
                     std::vector<int64_t>& input_counts) override {
    // Sizes may differ by rank: each peer's check carries the elements
    // sent to it, compared with those it expects.
    Check c(given_or(Kind::AllToAll, input), input_counts, output_counts);
    c.d.count = -1;
    const int p = size();
    if (c.send.empty()) c.send.assign(static_cast<size_t>(p), input.numel() / p);
    if (c.recv.empty()) c.recv.assign(static_cast<size_t>(p), output.numel() / p);
    // A rank whose own block differs in and out (the Communicator flags it)
    // moves nothing: its flagged check fails the collective on every rank,
    // this one when the peers' checks arrive.
    const bool refused = c.d.own_block_differs;
    return submit("ucx all_to_all", input.nbytes(), std::move(c),
                  [output, input, oc = output_counts, ic = input_counts, refused](Link& l) mutable {
                    if (!refused) ucx::all_to_all(l, output, input, oc, ic);
                  });
  }
  WorkPtr barrier() override {
    return submit("ucx barrier", 0, take_signature().value_or(Descriptor{}),
                  [](Link& l) { ucx::barrier(l); });
  }

  std::unique_ptr<Engine> create_subgroup(const std::vector<int>& ranks,
                                          std::shared_ptr<Store> store, Millis timeout) override {
    const int me = static_cast<int>(std::find(ranks.begin(), ranks.end(), rank()) - ranks.begin());
    COHORT_CHECK(me < static_cast<int>(ranks.size()), "caller is not a member");
    // A worker of its own: the group's tags cannot meet any other group's.
    return make_ucx_engine(std::move(store), me, static_cast<int>(ranks.size()), bind_address_,
                           interface_, timeout);
  }

 private:
  using Job = std::function<void(Link&)>;

  // The collective's check: its signature (given_or: what the user called,
  // avg, float16), and an all_to_all's elements per peer.
  struct Check {
    Check(Descriptor desc, std::vector<int64_t> s = {}, std::vector<int64_t> r = {})
        : d(desc), send(std::move(s)), recv(std::move(r)) {}
    Descriptor d;
    std::vector<int64_t> send, recv;
  };

  // The engine's thread runs queued collectives in order and, between them,
  // sleeps on UCX's event fd, so transfers advance while callers compute.
  static SerialWorker::Options serial_options(Worker& worker) {
    SerialWorker::Options o;
    o.refusal = "an earlier collective failed";
    o.idle = [&worker] { worker.idle(Millis(100)); };
    o.wake = [&worker] { worker.signal(); };
    return o;
  }

  // Runs `job` now on this thread when it is small and nothing is queued or
  // running (so collectives stay in issue order), else on the engine's thread.
  // `self_checked`: the job's first message is the collective's check.
  // Inline, a job that succeeds returns the shared finished Work: no Work
  // object and no std::function of its own per call, which add up on a
  // 1 KiB all-reduce of about 1 us (docs/benchmarks.md).
  template <class F>
  WorkPtr submit(const char* what, size_t bytes, Check c, F&& job, bool self_checked = false) {
    // The call's own timeout when it has one: a job that outlived the
    // caller's wait would only fail later, with no one to name the peer to.
    const auto deadline = Clock::now() + (c.d.timeout.count() > 0 ? c.d.timeout : timeout_);
    if (static_cast<int64_t>(bytes) <= inline_bytes()) {
      auto here = [&] {
        // This thread waits for every message it posts: waking the engine's
        // thread to progress them too made the two threads fight over the
        // worker (64 KiB, world 2: 35-50 us, 17-19 us without; README.md).
        Worker::Driving driving(*worker_);
        execute(what, c, self_checked, deadline, job);
      };
      std::exception_ptr error;
      if (serial_.run_here(what, here, error)) {
        if (!error) return done_work();
        auto work = std::make_shared<JobWork>(what, deadline);
        work->finish(std::move(error));
        return work;
      }
    }
    // The grace covers the job's own timeout error, which first asks the
    // peers whether they still answer.
    return serial_.submit(
        what, deadline,
        [this, what, c = std::move(c), self_checked, deadline,
         job = Job(std::forward<F>(job))]() mutable {
          execute(what, c, self_checked, deadline, job);
        },
        ucx::kProbeTime + Millis(500));
  }

  // Runs one collective between its check's start and end (see
  // collective_check.h): a neighbour that runs another one fails it at once.
  // Runs under the serial worker's rule (one at a time, none after a failure).
  template <class F>
  void execute(const char* what, Check& c, bool self_checked, Clock::time_point deadline, F& job) {
    c.d.seq = ++collectives_;
    bool ran = false;
    try {
      worker_->begin_collective(c.d, std::move(c.send), std::move(c.recv));
      if (!self_checked) worker_->post_check();
      Link link(channel_, what, deadline, &scratch_);
      job(link);
      ran = true;
      worker_->end_collective(deadline, true);
    } catch (...) {
      if (!ran) worker_->end_collective(deadline, false);
      throw;
    }
  }

  // Buffers like `t` for small_all_reduce, kept between calls (allocating
  // one costs more than the exchange), used by whoever runs a job: `exact`
  // has t's size, `full` is the same memory, at least a check message long
  // (it also receives a neighbour's check).
  struct SmallTmp {
    at::Tensor full, exact;
  };
  SmallTmp& small_tmp(const at::Tensor& t) {
    if (!small_tmp_.exact.defined() || small_tmp_.exact.numel() != t.numel() ||
        small_tmp_.exact.scalar_type() != t.scalar_type()) {
      const int64_t check = (kDescriptorWords * 8 + t.element_size() - 1) / t.element_size();
      small_tmp_.full = at::empty({std::max(t.numel(), check)}, t.options());
      small_tmp_.exact = small_tmp_.full.narrow(0, 0, t.numel());
    }
    return small_tmp_;
  }

  std::shared_ptr<Worker> worker_;
  CollectiveChannel channel_;
  std::string bind_address_;
  std::string interface_;
  Millis timeout_;
  algorithms::Scratch scratch_;  // used by whoever runs a job (one at a time: serial_)
  SmallTmp small_tmp_;           // likewise
  int64_t collectives_ = 0;      // run so far; likewise
  // Last: starts after everything above exists, and its destructor (which
  // runs the collectives already queued) runs first.
  SerialWorker serial_;
};

}  // namespace
}  // namespace cohort::ucx

namespace cohort {

std::unique_ptr<Engine> make_ucx_engine(std::shared_ptr<Store> store, int rank, int size,
                                        const std::string& bind_address,
                                        const std::string& interface, Millis timeout) {
  if (size > ucx::kMaxRanks) {
    throw ConfigError("ucx: a group of " + std::to_string(size) + " ranks exceeds the " +
                      std::to_string(ucx::kMaxRanks) + " its message tags can name");
  }
  ucx::WorkerConfig config{bind_address, interface};
  std::shared_ptr<ucx::Worker> worker;
  try {
    worker = std::make_shared<ucx::Worker>(*store, rank, size, config, timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError(std::string("ucx: rendezvous: ") + e.what());
  }
  return std::make_unique<ucx::UcxEngine>(std::move(worker), bind_address, interface, timeout);
}

}  // namespace cohort
