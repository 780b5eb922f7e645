// The MPI engine: every operation is one MPI call, non-blocking except for
// small all_reduce and broadcast (run_blocking below).
//
// Progress model, and why: the caller's thread starts each operation with a
// non-blocking call (MPI_Iallreduce, MPI_Isend, ...) and whoever waits polls
// MPI_Testall (op.h). We measured the alternative, a progress thread that
// owns MPI and runs blocking calls, on the 2-core development machine at
// world 2: handing a 1 KiB all_reduce to that thread and waking the caller
// costs 6.3 us per operation against 2.1 us for MPI_Iallreduce + MPI_Test
// on the caller's thread and 1.3 us for a plain MPI_Allreduce, and a
// spinning hand-off is worse still once two ranks share two cores. Calls
// from several threads are safe: MpiLock serializes them (cohort asks MPI
// for MPI_THREAD_SERIALIZED; under an application's MPI_THREAD_MULTIPLE
// the lock is off).
//
// Timeouts: wait(timeout) raises TimeoutError; MPI cannot cancel the
// operation, so the watchdog (watchdog.h) aborts the job if it stays
// unfinished past its timeout plus a grace period.
#include "cohort/comm/mpi/mpi_engine.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "cohort/comm/mpi/buffers.h"
#include "cohort/comm/mpi/datatypes.h"
#include "cohort/comm/mpi/op.h"
#include "cohort/comm/mpi/runtime.h"
#include "cohort/comm/mpi/signature_check.h"
#include "cohort/comm/mpi/watchdog.h"
#include "cohort/core/env.h"
#include "cohort/core/error.h"
#include "cohort/core/signature.h"
#include "cohort/core/work_then.h"

namespace cohort::mpi {
namespace {

// Any tag works as long as every member uses the same one; subgroups of one
// parent are created in the same order everywhere.
constexpr int kCreateGroupTag = 4242;

// The result of a blocking call, finished before the engine returns it.
class FinishedWork : public WorkImpl {
 public:
  explicit FinishedWork(std::string error) : error_(std::move(error)) {}
  bool is_completed() override { return true; }
  void wait(Millis) override {
    if (!error_.empty()) throw PeerError(error_);
  }

 private:
  std::string error_;
};

// Messages up to this many bytes take the blocking path (see
// blocking_max_bytes_). Measured on the 2-core development machine, world 2,
// against MPI_Iallreduce + MPI_Testall: blocking MPI_Allreduce was 1.3 us
// against 2.1 us at 1 KiB and reached 1.0x against 0.78x of the plain
// loop's busbw at 64 KiB (docs/benchmarks.md).
constexpr int64_t kDefaultBlockingMaxBytes = 256 << 10;

int64_t blocking_max_bytes_from_env() {
  auto v = env::get_int("COHORT_MPI_BLOCKING_BYTES", 0, std::numeric_limits<int>::max());
  return v ? *v : kDefaultBlockingMaxBytes;
}

class MpiEngine : public Engine {
 public:
  MpiEngine(MPI_Comm comm, std::string label, Millis timeout)
      : comm_(comm),
        label_(std::make_shared<const std::string>(std::move(label))),
        timeout_(timeout),
        blocking_max_bytes_(blocking_max_bytes_from_env()) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    // Errors become return codes, turned into exceptions by mpi_check and
    // MpiOp, instead of MPI's default of aborting the job.
    MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
    check_comm_ =
        watched_comm_dup(comm_,
                         "MPI_Comm_dup (the signature checks' communicator of " + *label_ +
                             ") on rank " + std::to_string(rank_) + " of " + std::to_string(size_),
                         timeout_);
    int* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &ub, &found);
    tag_ub_ = found && ub ? *ub : 32767;  // the standard's guaranteed minimum
  }

  ~MpiEngine() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) return;
    MpiLock lock;
    // Operations still in flight keep the communicator alive inside MPI.
    MPI_Comm_free(&check_comm_);
    MPI_Comm_free(&comm_);
  }

  std::string name() const override { return "mpi"; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }

  WorkPtr all_reduce(at::Tensor& t, ReduceOp op) override {
    if (auto failed = check(given_or(CollectiveKind::AllReduce, t, -1, op))) return failed;
    const auto type = to_mpi_type(t.scalar_type(), "all_reduce", true);
    const int n = to_mpi_count(t.numel(), "all_reduce");
    if (nbytes(t) <= blocking_max_bytes_) {
      auto o = new_op("MPI_Allreduce (all_reduce");
      return run_blocking(o, [&] {
        return MPI_Allreduce(MPI_IN_PLACE, t.data_ptr(), n, type, to_mpi_op(op), comm_);
      });
    }
    auto o = new_op("MPI_Iallreduce (all_reduce");
    o->keep(t);
    MpiLock lock;
    return launch(o, MPI_Iallreduce(MPI_IN_PLACE, t.data_ptr(), n, type, to_mpi_op(op), comm_,
                                    o->requests(1)));
  }

  WorkPtr broadcast(at::Tensor& t, int root) override {
    if (auto failed = check(given_or(CollectiveKind::Broadcast, t, root))) return failed;
    const auto type = to_mpi_type(t.scalar_type(), "broadcast");
    const int n = to_mpi_count(t.numel(), "broadcast");
    if (nbytes(t) <= blocking_max_bytes_) {
      auto o = new_op("MPI_Bcast (broadcast", ", root " + std::to_string(root));
      return run_blocking(o, [&] { return MPI_Bcast(t.data_ptr(), n, type, root, comm_); });
    }
    auto o = new_op("MPI_Ibcast (broadcast", ", root " + std::to_string(root));
    o->keep(t);
    MpiLock lock;
    return launch(o, MPI_Ibcast(t.data_ptr(), n, type, root, comm_, o->requests(1)));
  }

  WorkPtr reduce(at::Tensor& t, int root, ReduceOp op) override {
    if (auto failed = check(given_or(CollectiveKind::Reduce, t, root, op))) return failed;
    auto o = new_op("MPI_Ireduce (reduce", ", root " + std::to_string(root));
    const auto type = to_mpi_type(t.scalar_type(), "reduce", true);
    const int n = to_mpi_count(t.numel(), "reduce");
    o->keep(t);
    const bool is_root = rank_ == root;
    MpiLock lock;
    return launch(
        o, MPI_Ireduce(is_root ? MPI_IN_PLACE : t.data_ptr(), is_root ? t.data_ptr() : nullptr, n,
                       type, to_mpi_op(op), root, comm_, o->requests(1)));
  }

  WorkPtr all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override {
    if (auto failed = check(given_or(CollectiveKind::AllGather, input))) return failed;
    auto o = new_op("MPI_Iallgather (all_gather");
    const auto type = to_mpi_type(input.scalar_type(), "all_gather");
    const int n = to_mpi_count(input.numel(), "all_gather");
    to_mpi_count(input.numel() * size_, "all_gather output");
    const bool direct = back_to_back(outputs);
    at::Tensor recv = direct ? outputs[0] : at::empty({input.numel() * size_}, input.options());
    // MPI forbids a send buffer inside the receive buffer: that is MPI_IN_PLACE.
    const bool in_place = ptr(input) == ptr(recv) + rank_ * nbytes(input);
    o->keep(input);
    o->keep(recv);
    for (auto& t : outputs) o->keep(t);
    WorkPtr w;
    {
      MpiLock lock;
      w = launch(o, MPI_Iallgather(in_place ? MPI_IN_PLACE : input.data_ptr(), n, type,
                                   recv.data_ptr(), n, type, comm_, o->requests(1)));
    }
    if (direct) return w;
    return then(std::move(w), copy_out(outputs, recv));
  }

  bool has_native_reduce_scatter() const override { return true; }

  WorkPtr reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                         ReduceOp op) override {
    if (auto failed = check(given_or(CollectiveKind::ReduceScatter, output, -1, op))) return failed;
    auto o = new_op("MPI_Ireduce_scatter_block (reduce_scatter");
    const auto type = to_mpi_type(output.scalar_type(), "reduce_scatter", true);
    const int n = to_mpi_count(output.numel(), "reduce_scatter");
    to_mpi_count(output.numel() * size_, "reduce_scatter input");
    at::Tensor send = back_to_back(inputs) ? inputs[0] : concat(inputs);
    if (send.is_same(inputs[0]) &&
        overlaps(ptr(send), nbytes(output) * size_, ptr(output), nbytes(output))) {
      send = concat(inputs);  // MPI forbids overlapping buffers
    }
    o->keep(send);
    o->keep(output);
    for (auto& t : inputs) o->keep(t);
    MpiLock lock;
    return launch(o, MPI_Ireduce_scatter_block(send.data_ptr(), output.data_ptr(), n, type,
                                               to_mpi_op(op), comm_, o->requests(1)));
  }

  WorkPtr gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) override {
    if (auto failed = check(given_or(CollectiveKind::Gather, input, root))) return failed;
    auto o = new_op("MPI_Igather (gather", ", root " + std::to_string(root));
    const auto type = to_mpi_type(input.scalar_type(), "gather");
    const int n = to_mpi_count(input.numel(), "gather");
    const bool is_root = rank_ == root;
    at::Tensor recv;
    bool in_place = false;
    const bool direct = is_root && back_to_back(outputs);
    if (is_root) {
      to_mpi_count(input.numel() * size_, "gather output");
      recv = direct ? outputs[0] : at::empty({input.numel() * size_}, input.options());
      in_place = ptr(input) == ptr(recv) + rank_ * nbytes(input);
      o->keep(recv);
      for (auto& t : outputs) o->keep(t);
    }
    o->keep(input);
    WorkPtr w;
    {
      MpiLock lock;
      w = launch(o, MPI_Igather(in_place ? MPI_IN_PLACE : input.data_ptr(), n, type,
                                is_root ? recv.data_ptr() : nullptr, n, type, root, comm_,
                                o->requests(1)));
    }
    if (!is_root || direct) return w;
    return then(std::move(w), copy_out(outputs, recv));
  }

  WorkPtr scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) override {
    if (auto failed = check(given_or(CollectiveKind::Scatter, output, root))) return failed;
    auto o = new_op("MPI_Iscatter (scatter", ", root " + std::to_string(root));
    const auto type = to_mpi_type(output.scalar_type(), "scatter");
    const int n = to_mpi_count(output.numel(), "scatter");
    const bool is_root = rank_ == root;
    at::Tensor send;
    bool in_place = false;
    if (is_root) {
      to_mpi_count(output.numel() * size_, "scatter input");
      send = back_to_back(inputs) ? inputs[0] : concat(inputs);
      in_place = ptr(output) == ptr(send) + rank_ * nbytes(output);
      if (!in_place && overlaps(ptr(send), nbytes(output) * size_, ptr(output), nbytes(output))) {
        send = concat(inputs);
      }
      o->keep(send);
      for (auto& t : inputs) o->keep(t);
    }
    o->keep(output);
    MpiLock lock;
    return launch(o, MPI_Iscatter(is_root ? send.data_ptr() : nullptr, n, type,
                                  in_place ? MPI_IN_PLACE : output.data_ptr(), n, type, root, comm_,
                                  o->requests(1)));
  }

  WorkPtr all_to_all(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_counts,
                     std::vector<int64_t>& input_counts) override {
    auto o = new_op("MPI_Ialltoallv (all_to_all");
    const auto type = to_mpi_type(input.scalar_type(), "all_to_all");
    to_mpi_count(std::max(input.numel(), output.numel()), "all_to_all");
    // ints: send counts, send displacements, receive counts, receive
    // displacements, size() each; MPI reads them until the operation ends.
    auto& ints = o->ints();
    ints.assign(4 * static_cast<size_t>(size_), 0);
    int* sc = ints.data();
    int* sd = sc + size_;
    int* rc = sd + size_;
    int* rd = rc + size_;
    std::vector<int64_t> sent(static_cast<size_t>(size_)), expected(sent.size());
    for (int i = 0; i < size_; ++i) {
      sc[i] = static_cast<int>(input_counts.empty() ? input.numel() / size_ : input_counts[i]);
      rc[i] = static_cast<int>(output_counts.empty() ? output.numel() / size_ : output_counts[i]);
      sent[static_cast<size_t>(i)] = sc[i];
      expected[static_cast<size_t>(i)] = rc[i];
      if (i > 0) {
        sd[i] = sd[i - 1] + sc[i - 1];
        rd[i] = rd[i - 1] + rc[i - 1];
      }
    }
    auto s = given_or(CollectiveKind::AllToAll, input);
    s.count = -1;  // per peer: the elements sent to it, or expected from it
    if (auto failed = check(s, sent, expected)) return failed;
    at::Tensor send = input;
    if (overlaps(ptr(input), nbytes(input), ptr(output), nbytes(output))) send = input.clone();
    o->keep(send);
    o->keep(output);
    MpiLock lock;
    return launch(o, MPI_Ialltoallv(send.data_ptr(), sc, sd, type, output.data_ptr(), rc, rd, type,
                                    comm_, o->requests(1)));
  }

  WorkPtr barrier() override {
    if (auto failed = check(take_signature().value_or(Signature{}))) return failed;
    auto o = new_op("MPI_Ibarrier (barrier");
    MpiLock lock;
    return launch(o, MPI_Ibarrier(comm_, o->requests(1)));
  }

  WorkPtr send(at::Tensor& t, int dst, int tag) override {
    check_tag(tag, "send");
    auto o = new_op("MPI_Isend (send",
                    " to peer " + std::to_string(dst) + ", tag " + std::to_string(tag));
    const auto type = to_mpi_type(t.scalar_type(), "send");
    const int n = to_mpi_count(t.numel(), "send");
    o->keep(t);
    MpiLock lock;
    return launch(o, MPI_Isend(t.data_ptr(), n, type, dst, tag, comm_, o->requests(1)), false);
  }

  WorkPtr recv(at::Tensor& t, int src, int tag) override {
    check_tag(tag, "recv");
    auto o = new_op("MPI_Irecv (recv",
                    " from peer " + std::to_string(src) + ", tag " + std::to_string(tag));
    const auto type = to_mpi_type(t.scalar_type(), "recv");
    const int n = to_mpi_count(t.numel(), "recv");
    o->keep(t);
    o->expect_message(nbytes(t), caller_dtype_or(t.scalar_type()));
    MpiLock lock;
    return launch(o, MPI_Irecv(t.data_ptr(), n, type, src, tag, comm_, o->requests(1)), false);
  }

  std::unique_ptr<Engine> create_subgroup(const std::vector<int>& ranks,
                                          std::shared_ptr<Store> /*store*/,
                                          Millis timeout) override {
    // Only the members call this, so MPI_Comm_split (collective over the
    // whole parent) will not do; MPI_Comm_create_group involves the members
    // alone. The store is unused: MPI needs no rendezvous.
    std::string listed;
    for (int r : ranks) listed += (listed.empty() ? "" : ", ") + std::to_string(r);
    const std::string label = *label_ + "/[" + listed + "]";
    auto o = std::make_shared<MpiOp>("MPI_Comm_create_group (new subgroup " + label + ") on rank " +
                                         std::to_string(rank_) + " of " + std::to_string(size_),
                                     timeout);
    Watchdog::instance().watch(o);
    MPI_Comm sub = MPI_COMM_NULL;
    {
      MpiLock lock;
      MPI_Group parent_group = MPI_GROUP_NULL, group = MPI_GROUP_NULL;
      MPI_Comm_group(comm_, &parent_group);
      int code = MPI_Group_incl(parent_group, static_cast<int>(ranks.size()), ranks.data(), &group);
      if (code == MPI_SUCCESS) code = MPI_Comm_create_group(comm_, group, kCreateGroupTag, &sub);
      MPI_Group_free(&group);
      MPI_Group_free(&parent_group);
      o->mark_finished();
      mpi_check(code, o->what());
    }
    return std::make_unique<MpiEngine>(sub, label, timeout);
  }

 private:
  std::shared_ptr<MpiOp> new_op(const char* call, std::string detail = {}) const {
    return std::make_shared<MpiOp>(OpName{call, std::move(detail), rank_, size_, label_}, timeout_);
  }

  // Called with the MpiLock held, with the start call's return code.
  // A collective's Work probes its peers when its wait times out
  // (liveness_probe); point-to-point's one peer is already named.
  WorkPtr launch(const std::shared_ptr<MpiOp>& o, int code, bool collective = true) {
    mpi_check(code, o->what());
    Watchdog::instance().watch(o);
    Probe probe;
    if (collective && size_ > 1) {
      probe = [comm = check_comm_, rank = rank_, size = size_, seq = collectives_](Millis waited) {
        // Well inside the watchdog's grace, which ends the job after it.
        const auto most = std::min(std::clamp(waited / 2, Millis(500), Millis(5000)),
                                   Watchdog::instance().grace() / 2);
        return liveness_probe(comm, rank, size, seq, most);
      };
    }
    return std::make_shared<MpiWork>(o, std::move(probe));
  }

  // The blocking path: `call` runs on the caller's thread under the
  // watchdog and the returned work is already finished. Small collectives
  // gain the most (no request object, and Open MPI's tuned blocking
  // algorithms instead of libnbc's schedules). A rank that never joins is
  // a TimeoutError of the signature check before this call; one that stops
  // after its check leaves this call blocked inside MPI, and the watchdog
  // ends the job after timeout + grace with a message naming the call and
  // the rank. COHORT_MPI_BLOCKING_BYTES=0 turns it off.
  template <typename Call>
  WorkPtr run_blocking(const std::shared_ptr<MpiOp>& o, Call&& call) {
    Watchdog::instance().watch(o);
    int code;
    {
      MpiLock lock;
      code = call();
    }
    o->mark_finished();
    if (code == MPI_SUCCESS) {
      static const WorkPtr ok = std::make_shared<FinishedWork>("");
      return ok;
    }
    return std::make_shared<FinishedWork>(o->what() + ": " + error_string(code));
  }

  WorkPtr check(Signature s, const std::vector<int64_t>& send = {},
                const std::vector<int64_t>& recv = {}) {
    if (size_ == 1) return nullptr;
    s.seq = ++collectives_;
    return check_signature(
        check_comm_, rank_, size_, s, send, recv,
        new_op("MPI_Isend/MPI_Irecv (the signature check of collective #", std::to_string(s.seq)),
        s.timeout.count() > 0 ? s.timeout : timeout_);
  }

  void check_tag(int tag, const char* what) const {
    if (tag > tag_ub_) {
      throw InvalidArgument(std::string("engine mpi: ") + what + " tag " + std::to_string(tag) +
                            " exceeds MPI_TAG_UB (" + std::to_string(tag_ub_) + ")");
    }
  }

  MPI_Comm comm_;
  MPI_Comm check_comm_ = MPI_COMM_NULL;       // the signature checks' messages alone
  std::shared_ptr<const std::string> label_;  // "MPI_COMM_WORLD/[1, 3]"
  Millis timeout_;
  int rank_ = 0;
  int size_ = 1;
  int tag_ub_ = 32767;
  // all_reduce and broadcast of at most this many bytes block (run_blocking).
  int64_t blocking_max_bytes_;
  int64_t collectives_ = 0;  // checked so far (check_signature)
};

}  // namespace
}  // namespace cohort::mpi

namespace cohort {

std::unique_ptr<Engine> make_mpi_engine(int rank, int size, Millis timeout) {
  mpi::ensure_mpi();
  int world_rank = -1, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  if (rank != world_rank || size != world_size) {
    throw ConfigError("engine mpi: asked for rank " + std::to_string(rank) + " of " +
                      std::to_string(size) + ", but MPI_COMM_WORLD has this process as rank " +
                      std::to_string(world_rank) + " of " + std::to_string(world_size) +
                      "; start the job with mpirun (cohortrun --backend mpi)");
  }
  // Errors return, turned into the engines' exceptions, on the world too:
  // Open MPI raises some errors of a communicator's requests there (a
  // truncated message in MPI_Testall), whose default aborts the job.
  {
    mpi::MpiLock lock;
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
  }
  // A private copy of the world: cohort's messages never match the
  // application's own MPI calls. MPI_Comm_dup is collective and blocking,
  // hence watched.
  MPI_Comm comm = mpi::watched_comm_dup(
      MPI_COMM_WORLD,
      "MPI_Comm_dup (connect) on rank " + std::to_string(rank) + " of " + std::to_string(size),
      timeout);
  return std::make_unique<mpi::MpiEngine>(comm, "MPI_COMM_WORLD", timeout);
}

}  // namespace cohort
