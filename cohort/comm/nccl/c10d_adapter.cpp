// The NCCL engine: c10d's ProcessGroupNCCL, the one file that calls it.
// Built only when LibTorch has c10d's NCCL support (USE_C10D_NCCL).
#include "cohort/comm/nccl/c10d_adapter.h"

#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <thread>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include "cohort/comm/c10d_common.h"
#include "cohort/core/signature.h"

namespace cohort {
namespace {

using namespace c10d_common;  // the adapters' shared part
using Clock = std::chrono::steady_clock;

bool env_set(const char* name) { return std::getenv(name) != nullptr; }

// c10d's defaults end the process on a collective that fails or times out
// (TORCH_NCCL_ASYNC_ERROR_HANDLING=3 tears it down from the watchdog
// thread) and on a watchdog that stops beating (the heartbeat monitor
// aborts it). cohort never lets an engine end the process: 2 aborts the
// communicator only, after which wait() throws, and the monitor is off.
// c10d reads both when a group is made; a user's own setting is kept.
void set_error_handling_defaults() {
  if (!env_set("TORCH_NCCL_ASYNC_ERROR_HANDLING") && !env_set("NCCL_ASYNC_ERROR_HANDLING")) {
    setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2", 0);
  }
  if (!env_set("TORCH_NCCL_ENABLE_MONITORING")) setenv("TORCH_NCCL_ENABLE_MONITORING", "0", 0);
}

// c10d's blocking wait (TORCH_NCCL_BLOCKING_WAIT=1): the user asked for
// wait() to block the host until the operation finished or timed out.
bool blocking_wait() {
  for (const char* name : {"TORCH_NCCL_BLOCKING_WAIT", "NCCL_BLOCKING_WAIT"}) {
    const char* v = std::getenv(name);
    if (v) return std::string(v) == "1";
  }
  return false;
}

// Blocks the host until `work` finished or `deadline` passed (TimeoutError,
// with what `probe` says of the peers); rethrows its error; then the
// current stream waits for it too. What cohort itself must see on the host
// (a signature check, a CPU tensor's result) waits here, never in c10d's
// untimed synchronize().
void wait_on_host(c10d::Work& work, Clock::time_point deadline, Millis waited, const Probe& probe) {
  auto pause = std::chrono::microseconds(10);
  while (!work.isCompleted()) {
    if (Clock::now() >= deadline) {
      throw TimeoutError("timed out after " + std::to_string(waited.count()) +
                         " ms waiting for NCCL" + (probe ? probe(waited) : std::string()));
    }
    std::this_thread::sleep_for(pause);
    pause = std::min(pause * 2, std::chrono::microseconds(1000));
  }
  if (auto error = work.exception()) std::rethrow_exception(error);
  work.synchronize();
}

// An operation on CPU tensors: they went to the device for NCCL, and come
// back once it finished, so wait() blocks the host.
class HostResultWork : public WorkImpl {
 public:
  HostResultWork(c10::intrusive_ptr<c10d::Work> work, Probe probe,
                 std::vector<std::pair<at::Tensor, at::Tensor>> back)
      : work_(std::move(work)), probe_(std::move(probe)), back_(std::move(back)) {}

  bool is_completed() override { return work_->isCompleted(); }

  void wait(Millis timeout) override {
    try {
      wait_on_host(*work_, Clock::now() + timeout, timeout, probe_);
    } catch (const cohort::Error&) {
      throw;
    } catch (const std::exception& e) {
      const auto m = c10d_message(e);
      if (probe_ && says_timeout(m)) throw TimeoutError(m + probe_(timeout));
      rethrow_translated(e);
    }
    for (auto& [host, device] : back_) host.copy_(device);
    back_.clear();
  }

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  Probe probe_;
  std::vector<std::pair<at::Tensor, at::Tensor>> back_;  // (caller's, device copy)
};

// One operation's tensors as NCCL needs them: CUDA tensors as they are, CPU
// tensors (cohort's own small exchanges, such as split()'s) through a
// device copy, written back when the operation's wait() returns.
struct OnDevice {
  explicit OnDevice(at::Device d) : device(d) {}

  at::Device device;
  std::vector<std::pair<at::Tensor, at::Tensor>> back;  // (caller's, device copy)

  at::Tensor in(const at::Tensor& t) const { return t.is_cuda() ? t : t.to(device); }
  at::Tensor out(const at::Tensor& t, bool also_read = true) {
    if (t.is_cuda()) return t;
    auto d = also_read ? t.to(device) : at::empty_like(t, t.options().device(device));
    back.emplace_back(t, d);
    return d;
  }
  std::vector<at::Tensor> in(const std::vector<at::Tensor>& ts) const {
    std::vector<at::Tensor> out;
    for (auto& t : ts) out.push_back(in(t));
    return out;
  }
  std::vector<at::Tensor> out(const std::vector<at::Tensor>& ts) {
    std::vector<at::Tensor> d;
    for (auto& t : ts) d.push_back(out(t, false));
    return d;
  }
};

// Each collective first compares its signature (cohort/core/signature.h)
// with every other rank's: NCCL itself checks nothing, and ranks whose
// sizes differ would hang in the collective or read past a buffer. The
// rows go in one all_gather of a few words on the same communicator, and
// the host waits for it (within the operation's timeout) before the
// collective is issued: the price of the check is one small collective and
// one host round trip per collective.
class NcclEngine : public Engine {
 public:
  NcclEngine(c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg, std::shared_ptr<cohort::Store> store,
             at::Device device, Millis timeout)
      : pg_(std::move(pg)),
        store_(std::move(store)),
        device_(device),
        timeout_(timeout),
        mode_(blocking_wait() ? WaitMode::Host : WaitMode::Stream) {}

  std::string name() const override { return "nccl"; }
  int rank() const override { return pg_->getRank(); }
  int size() const override { return pg_->getSize(); }
  bool carries_device_tensors() const override { return true; }
  bool has_native_reduce_scatter() const override { return true; }

  WorkPtr all_reduce(at::Tensor& tensor, ReduceOp op) override {
    const auto s = given_or(CollectiveKind::AllReduce, tensor, -1, op);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<at::Tensor> ts{d.out(tensor)};
    c10d::AllreduceOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = op_timeout(s);
    return call([&] { return pg_->allreduce(ts, o); }, d);
  }

  WorkPtr broadcast(at::Tensor& tensor, int root) override {
    const auto s = given_or(CollectiveKind::Broadcast, tensor, root);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<at::Tensor> ts{d.out(tensor)};
    c10d::BroadcastOptions o;
    o.rootRank = root;
    o.timeout = op_timeout(s);
    return call([&] { return pg_->broadcast(ts, o); }, d);
  }

  WorkPtr reduce(at::Tensor& tensor, int root, ReduceOp op) override {
    const auto s = given_or(CollectiveKind::Reduce, tensor, root, op);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<at::Tensor> ts{d.out(tensor)};
    c10d::ReduceOptions o;
    o.rootRank = root;
    o.reduceOp = to_c10d(op);
    o.timeout = op_timeout(s);
    return call([&] { return pg_->reduce(ts, o); }, d);
  }

  WorkPtr all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) override {
    const auto s = given_or(CollectiveKind::AllGather, input);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<std::vector<at::Tensor>> out{d.out(outputs)};
    std::vector<at::Tensor> in{d.in(input)};
    c10d::AllgatherOptions o;
    o.timeout = op_timeout(s);
    return call([&] { return pg_->allgather(out, in, o); }, d);
  }

  WorkPtr reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                         ReduceOp op) override {
    const auto s = given_or(CollectiveKind::ReduceScatter, output, -1, op);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<at::Tensor> out{d.out(output, false)};
    std::vector<std::vector<at::Tensor>> in{d.in(inputs)};
    c10d::ReduceScatterOptions o;
    o.reduceOp = to_c10d(op);
    o.timeout = op_timeout(s);
    return call([&] { return pg_->reduce_scatter(out, in, o); }, d);
  }

  WorkPtr gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) override {
    const auto s = given_or(CollectiveKind::Gather, input, root);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<std::vector<at::Tensor>> out;
    if (!outputs.empty()) out.push_back(d.out(outputs));
    std::vector<at::Tensor> in{d.in(input)};
    c10d::GatherOptions o;
    o.rootRank = root;
    o.timeout = op_timeout(s);
    return call([&] { return pg_->gather(out, in, o); }, d);
  }

  WorkPtr scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) override {
    const auto s = given_or(CollectiveKind::Scatter, output, root);
    if (auto failed = check(s)) return failed;
    OnDevice d(device_);
    std::vector<at::Tensor> out{d.out(output, false)};
    std::vector<std::vector<at::Tensor>> in;
    if (!inputs.empty()) in.push_back(d.in(inputs));
    c10d::ScatterOptions o;
    o.rootRank = root;
    o.timeout = op_timeout(s);
    return call([&] { return pg_->scatter(out, in, o); }, d);
  }

  WorkPtr all_to_all(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_counts,
                     std::vector<int64_t>& input_counts) override {
    const auto c = all_to_all_check(output, input, output_counts, input_counts, size());
    if (auto failed = check(c.signature, c.send, c.recv)) return failed;
    OnDevice d(device_);
    auto out = d.out(output, false);
    auto in = d.in(input);
    c10d::AllToAllOptions o;
    o.timeout = op_timeout(c.signature);
    return call([&] { return pg_->alltoall_base(out, in, output_counts, input_counts, o); }, d);
  }

  WorkPtr barrier() override {
    const auto s = take_signature().value_or(Signature{});
    if (auto failed = check(s)) return failed;
    c10d::BarrierOptions o;
    o.device_ids = {device_.index()};
    o.timeout = op_timeout(s);
    return call([&] { return pg_->barrier(o); }, OnDevice{device_});
  }

  // NCCL matches point-to-point messages by their order between two ranks;
  // c10d passes no tag to it.
  WorkPtr send(at::Tensor& tensor, int dst, int tag) override {
    OnDevice d(device_);
    std::vector<at::Tensor> ts{d.in(tensor)};
    return call([&] { return pg_->send(ts, dst, tag); }, d, false);
  }

  WorkPtr recv(at::Tensor& tensor, int src, int tag) override {
    OnDevice d(device_);
    std::vector<at::Tensor> ts{d.out(tensor, false)};
    return call([&] { return pg_->recv(ts, src, tag); }, d, false);
  }

  std::unique_ptr<Engine> create_subgroup(const std::vector<int>& ranks,
                                          std::shared_ptr<cohort::Store> store,
                                          Millis timeout) override {
    const int me = member_index(ranks, rank());
    return connect(std::move(store), me, static_cast<int>(ranks.size()), device_, timeout);
  }

  static std::unique_ptr<Engine> connect(std::shared_ptr<cohort::Store> store, int rank, int size,
                                         at::Device device, Millis timeout) {
    set_error_handling_defaults();
    publish_process(*store, rank);
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto bridge = c10::make_intrusive<StoreBridge>(store);
    try {
      auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(bridge, rank, size, options);
      pg->setBoundDeviceId(device);
      auto engine = std::make_unique<NcclEngine>(pg, std::move(store), device, timeout);
      // NCCL makes its communicator at the first collective: one here, so
      // that ranks that cannot connect fail in init() within the timeout.
      auto one = at::zeros({1}, at::TensorOptions().device(device));
      std::vector<at::Tensor> ts{one};
      wait_on_host(*pg->allreduce(ts), Clock::now() + timeout, timeout, nullptr);
      return engine;
    } catch (const cohort::Error&) {
      throw;
    } catch (const std::exception& e) {
      rethrow_translated(e);
    }
  }

 private:
  // The Communicator's timeout for this operation, else the engine's: the
  // watchdog aborts the communicator once it passed.
  Millis op_timeout(const Signature& s) const {
    return s.timeout.count() > 0 ? s.timeout : timeout_;
  }

  template <typename F>
  WorkPtr call(F&& launch, OnDevice d, bool collective = true) {
    Probe probe;
    if (collective && size() > 1) probe = group_probe(store_, rank(), size(), collectives_);
    try {
      auto work = launch();
      if (!d.back.empty()) {
        return std::make_shared<HostResultWork>(std::move(work), std::move(probe),
                                                std::move(d.back));
      }
      return std::make_shared<C10dWork>(std::move(work), std::move(probe), mode_);
    } catch (const std::exception& e) {
      rethrow_translated(e);
    }
  }

  // Null when every rank called this collective as this one did; else a
  // failed Work (MismatchError naming both calls, TimeoutError naming what
  // the liveness probe found, or PeerError). Row q of this rank's words is
  // what it tells rank q; the all_gather brings every rank's rows, and rank
  // q's row for this rank is the one compared.
  WorkPtr check(Signature s, const std::vector<int64_t>& send = {},
                const std::vector<int64_t>& recv = {}) {
    const int p = size(), me = rank();
    if (p == 1) return nullptr;
    s.seq = ++collectives_;
    const int64_t w = kSignatureWords;
    std::vector<int64_t> mine_rows(static_cast<size_t>(p * w));
    fill_rows(s, send, p, mine_rows.data());
    const auto timeout = op_timeout(s);
    const std::string what = "nccl: the check of collective #" + std::to_string(s.seq) +
                             " (this rank called " + s.describe() + ")";
    std::vector<int64_t> their_rows(mine_rows.size());
    try {
      auto mine = at::from_blob(mine_rows.data(), {p * w}, at::kLong).to(device_);
      auto all = at::empty({p, p * w}, mine.options());
      std::vector<std::vector<at::Tensor>> out(1);
      for (int q = 0; q < p; ++q) out[0].push_back(all[q]);
      std::vector<at::Tensor> in{mine};
      c10d::AllgatherOptions o;
      o.timeout = timeout;
      wait_on_host(*pg_->allgather(out, in, o), Clock::now() + timeout, timeout,
                   group_probe(store_, rank(), size(), s.seq));
      auto rows = all.narrow(1, me * w, w).to(at::kCPU).contiguous();
      std::copy_n(rows.data_ptr<int64_t>(), their_rows.size(), their_rows.data());
    } catch (const std::exception& e) {
      const auto m =
          dynamic_cast<const cohort::Error*>(&e) ? std::string(e.what()) : c10d_message(e);
      auto error = says_timeout(m) ? std::make_exception_ptr(TimeoutError(what + ": " + m))
                                   : std::make_exception_ptr(PeerError(what + " failed: " + m));
      return failed_work("nccl signature check", error);
    }
    const auto differs = compare_rows("nccl", s, recv, me, p, their_rows.data());
    if (differs.empty()) return nullptr;
    return failed_work("nccl signature check", std::make_exception_ptr(MismatchError(differs)));
  }

  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
  std::shared_ptr<cohort::Store> store_;  // the group's: the liveness probe's
  at::Device device_;
  Millis timeout_;
  WaitMode mode_;
  int64_t collectives_ = 0;  // checked so far
};

}  // namespace

std::unique_ptr<Engine> make_nccl_engine(std::shared_ptr<Store> store, int rank, int size,
                                         Millis timeout) {
  c10::DeviceIndex index = 0;
  try {
    index = c10::cuda::current_device();
  } catch (const std::exception& e) {
    throw ConfigError("nccl: no CUDA device: " + c10d_message(e));
  }
  const at::Device device(at::kCUDA, index);
  return NcclEngine::connect(std::move(store), rank, size, device, timeout);
}

}  // namespace cohort
