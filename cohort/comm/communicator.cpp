// The Communicator itself: construction, the prologue every operation shares
// (context, refusals, the debug check, the Work that marks the communicator
// failed on error), the choice of algorithm, barrier and point-to-point.
// Reductions and data movement have files of their own.
#include "cohort/comm/communicator.h"

#include "cohort/algorithms/executor.h"
#include "cohort/comm/collective_checker.h"
#include "cohort/comm/communicator_internal.h"
#include "cohort/comm/in_flight.h"
#include "cohort/core/error.h"
#include "cohort/core/signature.h"
#include "cohort/core/tensor_checks.h"
#include "cohort/observability/counting_engine.h"
#include "cohort/observability/tick_clock.h"

namespace cohort {

struct Communicator::Health {
  std::mutex mu;
  bool broken = false;
  std::string reason;
};

namespace {

// The all-gather size (output bytes) from which an engine that copies out of
// a buffer of its own is passed over for cohort's ring (resolve_algorithm()).
constexpr int64_t kRingGatherBytes = int64_t{4} << 20;

// Runs the engine's launch of a point-to-point call. A transport that refuses
// at issue (a peer that has closed its connections) throws a PeerError that
// names the call, and the communicator counts as failed, as after a failed
// wait().
template <class Call, class Health, class Launch>
WorkPtr issue_p2p(const Call& call, Health& health, Launch&& launch) {
  try {
    return launch();
  } catch (const PeerError& e) {
    const std::string why = "cohort: " + call.where() + " failed: " + e.what();
    {
      std::lock_guard<std::mutex> lock(health.mu);
      if (!health.broken) {
        health.broken = true;
        health.reason = why;
      }
    }
    throw PeerError(why);
  }
}

}  // namespace

namespace detail {

WorkPtr agree(Engine& engine, const Signature& s, Millis timeout) {
  auto w = check_signature(engine, s);
  try {
    w->wait(timeout);
  } catch (const Error&) {
    return w;
  }
  return nullptr;
}

}  // namespace detail

Communicator::Communicator(std::unique_ptr<Engine> engine, std::shared_ptr<Store> store,
                           CommunicatorOptions options)
    : counters_(std::make_shared<StatsCounters>()),
      engine_(CountingEngine::wrap(std::move(engine), counters_)),
      store_(std::move(store)),
      options_(std::move(options)),
      rank_(engine_->rank()),
      size_(engine_->size()),
      device_tensors_(engine_->carries_device_tensors()),
      in_flight_(std::make_unique<detail::InFlight>()),
      health_(std::make_shared<Health>()) {
  // Once per process, before the first counted operation.
  tick_clock::calibrate();
  if (options_.debug_checks) {
    checker_ = std::make_unique<CollectiveChecker>(store_, rank_, size_);
  }
  if (kTracingCompiled && !options_.trace_dir.empty()) {
    tracer_ = std::make_shared<Tracer>(
        rank_, size_, options_.trace_dir + "/rank-" + std::to_string(rank_) + ".json",
        options_.trace_max_events > 0 ? static_cast<size_t>(options_.trace_max_events) : 0);
    align_trace_clock();
  }
  // No environment here: init() reads it, connect() is explicit.
  // cohort's algorithms read and write host memory: over an engine that
  // moves device tensors itself, every collective is the engine's.
  if (options_.algorithm == Algorithm::Default || device_tensors_) {
    options_.algorithm = Algorithm::Engine;
  }
  if (options_.calibration_max_bytes <= 0) options_.calibration_max_bytes = 64 << 20;
  // Construction is collective, so a communicator whose default is an
  // algorithm builds its private engine here; built lazily, a rank whose
  // peers never call would block inside the call rather than time out in
  // wait(). (A per-call algo on an engine-default communicator still builds
  // it at that call, which every rank reaches in the same order.)
  if (options_.algorithm != Algorithm::Engine) algorithms();
}

Communicator::~Communicator() {
  // Dropped handles of collectives the engine finished still get their
  // results; nothing here blocks.
  in_flight_->drain();
}

void Communicator::align_trace_clock() {
  // Rank 0 answers a few pings from each rank in turn with its clock; a
  // rank takes the exchange with the shortest round trip and assumes the
  // answer was read halfway through it (the NTP estimate, good to half the
  // round trip). Counted as calibration traffic.
  constexpr int kRounds = 5;
  constexpr int kTag = 32001;
  if (size_ == 1) return;
  OpKindScope scope(OpKind::Calibration);
  auto ping = torch::zeros({1}, torch::kLong);
  auto clock = torch::zeros({1}, torch::kLong);
  auto now_ns = [] {
    return static_cast<int64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                    std::chrono::steady_clock::now().time_since_epoch())
                                    .count());
  };
  try {
    if (rank_ == 0) {
      for (int peer = 1; peer < size_; ++peer) {
        for (int k = 0; k < kRounds; ++k) {
          engine_->recv(ping, peer, kTag)->wait(options_.timeout);
          clock.fill_(now_ns());
          engine_->send(clock, peer, kTag)->wait(options_.timeout);
        }
      }
      return;
    }
    double best_rtt = 1e300, best_offset = 0;
    for (int k = 0; k < kRounds; ++k) {
      const int64_t sent = now_ns();
      engine_->send(ping, 0, kTag)->wait(options_.timeout);
      engine_->recv(clock, 0, kTag)->wait(options_.timeout);
      const int64_t back = now_ns();
      const double rtt = static_cast<double>(back - sent);
      if (rtt < best_rtt) {
        best_rtt = rtt;
        best_offset = static_cast<double>(clock.item<int64_t>()) - (sent + rtt / 2);
      }
    }
    tracer_->set_clock_offset(best_offset / 1000, best_rtt / 1000);
  } catch (const Error& e) {
    throw Error("cohort: " + name() + " rank " + std::to_string(rank_) +
                ": aligning the trace's clock with rank 0 failed: " + e.what());
  }
}

CommStats Communicator::stats() const { return counters_->snapshot(); }

void Communicator::reset_stats() { counters_->reset(); }

algorithms::Executor& Communicator::algorithms() {
  if (!algorithms_)
    algorithms_ = std::make_unique<algorithms::Executor>(*engine_, store_, options_);
  return *algorithms_;
}

Algorithm Communicator::resolve_algorithm(Collective op, int64_t bytes, Algorithm requested) {
  const Algorithm a = requested == Algorithm::Default ? options_.algorithm : requested;
  if (a == Algorithm::Engine || device_tensors_) {
    // Gloo 1.13 has no reduce_scatter: the engine's fallback all-reduces the
    // whole input (twice a ring's traffic), so its "native" choice is the ring.
    if (op == Collective::ReduceScatter && size_ > 1 && !engine_->has_native_reduce_scatter()) {
      return Algorithm::Ring;
    }
    // cohort's ring against Gloo's all-gather, agreement included
    // (cohort-bench collectives --op all_gather --algo all, world 4 on 2
    // cores): even at 2 MiB, 1.3x faster from 4 MiB, 2.0x at 32 MiB. Only
    // as the communicator's choice (an operation that names Engine gets
    // the engine's own), and never for device tensors (the ring reads host
    // memory).
    if (op == Collective::AllGather && requested == Algorithm::Default && !device_tensors_ &&
        size_ > 1 && !engine_->gathers_into_outputs() && bytes >= kRingGatherBytes) {
      return Algorithm::Ring;
    }
    return Algorithm::Engine;
  }
  return algorithms().resolve(op, a, bytes);
}

std::string Communicator::describe_cost_model(Collective op) {
  return algorithms::describe(op, algorithms().calibration(op));
}

Communicator::Call Communicator::begin(const std::string& op, Millis timeout,
                                       std::vector<int> peers) const {
  Call call;
  call.ctx.op = op;
  call.ctx.group = options_.name;
  call.ctx.rank = rank_;
  call.ctx.size = size_;
  call.ctx.peers = std::move(peers);
  call.ctx.device_tensors = device_tensors_;
  // Engine traffic from here to the next operation counts under this kind.
  call.kind = op_kind_from_name(op);
  call.issued_ticks = tick_clock::now();
  if (active(tracer_)) call.issued = std::chrono::steady_clock::now();
  set_current_op_kind(call.kind);
  call.ctx.timeout = timeout == kDefaultTimeout ? options_.timeout : timeout;
  if (call.ctx.timeout.count() <= 0) {
    call.refuse("timeout must be positive, got " + std::to_string(call.ctx.timeout.count()) +
                " ms");
  }
  std::lock_guard<std::mutex> lock(health_->mu);
  if (health_->broken) {
    throw PeerError("cohort: " + call.where() +
                    ": refused, this communicator failed earlier: " + health_->reason);
  }
  return call;
}

Communicator::Call Communicator::begin_collective(const std::string& op, Millis timeout,
                                                  const detail::Access& access) {
  // Before begin(): a waited-for collective that failed makes it refuse.
  settle(access);
  auto call = begin(op, timeout, {});
  call.ctx.all_peers = true;
  // Collectives alone are numbered: every rank issues the same ones in the
  // same order, whatever point-to-point traffic each has between them.
  if (active(tracer_)) call.seq = ++trace_seq_;
  call.ctx.debug_checks = checker_ != nullptr;
  call.access = &access;
  return call;
}

void Communicator::settle(const detail::Access& access) { in_flight_->settle(access); }

Work Communicator::track_in_flight(const detail::Access& access, Work work) {
  in_flight_->add(access, work);
  return work;
}

void Communicator::Call::refuse(const std::string& why) const {
  throw InvalidArgument("cohort: " + where() + ": " + why);
}

void Communicator::verify_agreement(const Call& call, const std::string& fingerprint) {
  try {
    checker_->verify(fingerprint, call.ctx.timeout);
  } catch (const MismatchError& e) {
    throw MismatchError("cohort: " + call.where() + ": " + e.what());
  } catch (const TimeoutError& e) {
    throw TimeoutError("cohort: " + call.where() + ": " + e.what());
  }
}

Work Communicator::finish(const Call& call, WorkPtr impl, std::function<void()> on_success) {
  auto health = health_;
  OpTrace trace;
  if (Tracer* t = active(tracer_)) {
    // The issue (checks, copies, handing the operation to the engine) as a
    // complete event; its time in flight and waits are recorded by track().
    trace.tracer = tracer_;
    trace.issued = call.issued;
    trace.id = t->new_id();
    // A collective's number, or a send's or receive's peer.
    trace.args = {TraceArg::str("group", options_.name),
                  call.ctx.all_peers ? TraceArg::num("seq", static_cast<double>(call.seq))
                                     : TraceArg::num("peer", call.ctx.peers.at(0)),
                  TraceArg::num("bytes", static_cast<double>(call.bytes)),
                  TraceArg::str("algorithm", to_string(call.algo)),
                  TraceArg::num("id", static_cast<double>(trace.id))};
    t->complete(call.ctx.op, "comm", call.issued, std::chrono::steady_clock::now(), trace.args);
  }
  const bool traced = trace.tracer != nullptr;
  impl = track(std::move(impl), counters_, call.kind, call.issued_ticks, std::move(trace));
  // An operation the engine finished at issue, with nothing to run after it,
  // needs no state: the empty Work (no allocation, no context copy) is done.
  if (!traced && !on_success && impl == done_work()) return Work();
  Work work(std::move(impl), call.ctx, std::move(on_success), [health](const std::string& why) {
    std::lock_guard<std::mutex> lock(health->mu);
    if (!health->broken) {
      health->broken = true;
      health->reason = why;
    }
  });
  if (call.access) in_flight_->add(*call.access, work);
  return work;
}

Work Communicator::finish_reduction(const Call& call, WorkPtr impl, torch::Tensor out,
                                    torch::Tensor buf, ReduceOp op) {
  // The engine reduced the caller's own tensor, as asked: no completion
  // step, which saves a std::function (a heap allocation) per call.
  if (op != ReduceOp::Avg && buf.is_same(out)) return finish(call, std::move(impl));
  return finish(call, std::move(impl),
                [out, buf, op, n = size_]() mutable { detail::finish_reduction(out, buf, op, n); });
}

void Communicator::check_root(const Call& call, int root) const {
  if (root < 0 || root >= size_) {
    call.refuse("root " + std::to_string(root) + " is outside the group of " +
                std::to_string(size_));
  }
}

void Communicator::check_peer(const Call& call, int peer) const {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    call.refuse("peer " + std::to_string(peer) + " is not another rank of the group of " +
                std::to_string(size_));
  }
}

void Communicator::check_per_rank(const Call& call, const std::vector<torch::Tensor>& list,
                                  const torch::Tensor& ref, const std::string& name) const {
  if (static_cast<int>(list.size()) != size_) {
    call.refuse(name + " has " + std::to_string(list.size()) + " tensors, expected one per rank (" +
                std::to_string(size_) + ")");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    check_like(list[i], ref, call.ctx, name + "[" + std::to_string(i) + "]");
  }
}

Work Communicator::barrier(const BarrierOptions& opts) {
  const detail::Access nothing;
  auto call = begin_collective("barrier", opts.timeout, nothing);
  debug_check(call, [] { return std::string("barrier()"); });
  Signature sig;
  sig.timeout = call.ctx.timeout;
  SignatureScope scope(sig);
  // The collectives issued before it complete by the barrier's completion,
  // their results in place (handles the caller dropped included); each
  // rank issued them before the barrier, so waiting for them cannot hang.
  auto earlier = in_flight_->pending();
  if (earlier.empty()) return finish(call, engine_->barrier());
  return finish(call, engine_->barrier(), [earlier]() mutable {
    for (auto& w : earlier) w.wait();
  });
}

Work Communicator::send(const torch::Tensor& caller_tensor, int dst, const SendOptions& opts) {
  // Point-to-point is not tracked (waiting for it could need its peer's
  // later call), but waits for this group's collectives on its bytes.
  detail::Access access;
  access.read(caller_tensor);
  settle(access);
  if (detail::stages(*engine_, detail::on_device(caller_tensor))) {
    auto s = detail::staging(*this, "send");
    auto host = s.read(caller_tensor, "tensor");
    s.ready();
    return s.finish(send(host, dst, opts));
  }
  auto tensor = detail::data_of(caller_tensor);
  auto call = begin("send", opts.timeout, {dst});
  check_peer(call, dst);
  check_tensor(tensor, call.ctx, "tensor");
  if (opts.tag < 0) call.refuse("tag must be >= 0");
  call.bytes = detail::nbytes(tensor);
  auto wire = movement_view(tensor);
  // The caller's dtype, which the wire view hides (bf16 as f16 bits), for
  // the engines that check or name it (UCX, MPI).
  CallerDtypeScope dtype(tensor.scalar_type());
  return finish(call,
                issue_p2p(call, *health_, [&] { return engine_->send(wire, dst, opts.tag); }));
}

Work Communicator::recv(torch::Tensor& caller_tensor, int src, const RecvOptions& opts) {
  // Point-to-point is not tracked (waiting for it could need its peer's
  // later call), but waits for this group's collectives on its bytes.
  detail::Access access;
  access.write(caller_tensor);
  settle(access);
  if (detail::stages(*engine_, detail::on_device(caller_tensor))) {
    auto s = detail::staging(*this, "recv");
    auto host = s.write(caller_tensor, "tensor");
    s.ready();
    return s.finish(recv(host, src, opts));
  }
  auto tensor = detail::data_of(caller_tensor);
  auto call = begin("recv", opts.timeout, {src});
  check_peer(call, src);
  check_tensor(tensor, call.ctx, "tensor");
  if (opts.tag < 0) call.refuse("tag must be >= 0");
  call.bytes = detail::nbytes(tensor);
  auto wire = movement_view(tensor);
  CallerDtypeScope dtype(tensor.scalar_type());
  return finish(call,
                issue_p2p(call, *health_, [&] { return engine_->recv(wire, src, opts.tag); }));
}

}  // namespace cohort
