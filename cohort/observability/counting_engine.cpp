#include "cohort/observability/counting_engine.h"

#include "cohort/observability/tick_clock.h"

namespace cohort {
namespace {

thread_local OpKind t_current = OpKind::Other;

uint64_t bytes_of(const at::Tensor& t) {
  return static_cast<uint64_t>(t.numel()) * static_cast<uint64_t>(t.element_size());
}

double seconds(uint64_t ns) { return static_cast<double>(ns) * 1e-9; }

}  // namespace

CommStats StatsCounters::snapshot() const {
  CommStats s;
  s.resets = resets.load(std::memory_order_relaxed);
  s.bytes_sent_ever = sent_before_resets.load(std::memory_order_relaxed);
  for (size_t i = 0; i < kOpKindCount; ++i) {
    auto& k = kinds[i];
    auto& o = s.ops[i];
    o.calls = k.calls.load(std::memory_order_relaxed);
    o.completed = k.completed.load(std::memory_order_relaxed);
    o.bytes_sent = k.sent.load(std::memory_order_relaxed);
    s.bytes_sent_ever += o.bytes_sent;
    o.bytes_received = k.received.load(std::memory_order_relaxed);
    o.seconds_in_flight = seconds(k.in_flight_ns.load(std::memory_order_relaxed));
    o.seconds_waiting = seconds(k.waiting_ns.load(std::memory_order_relaxed));
  }
  return s;
}

void StatsCounters::reset() {
  resets.fetch_add(1, std::memory_order_relaxed);
  for (auto& k : kinds) {
    // exchange: a byte counted while resetting is moved, not lost.
    sent_before_resets.fetch_add(k.sent.exchange(0, std::memory_order_relaxed),
                                 std::memory_order_relaxed);
    for (auto* a : {&k.calls, &k.completed, &k.received, &k.in_flight_ns, &k.waiting_ns}) {
      a->store(0, std::memory_order_relaxed);
    }
  }
}

OpKind current_op_kind() { return t_current; }
void set_current_op_kind(OpKind kind) { t_current = kind; }
OpKindScope::OpKindScope(OpKind kind) : previous_(t_current) { t_current = kind; }
OpKindScope::~OpKindScope() { t_current = previous_; }

// --- closed forms --------------------------------------------------------

namespace wire_model {
namespace {

// Binomial tree rooted at virtual rank 0: v's parent is v minus its highest
// bit; its children are v + 2^k for every 2^k > v below the size.
uint64_t tree_children(int v, int size) {
  uint64_t children = 0;
  for (int64_t step = 1; step < size; step <<= 1) {
    if (step > v && v + step < size) ++children;
  }
  return children;
}

}  // namespace

Bytes all_reduce(uint64_t n, int, int size) {
  if (size <= 1) return {};
  const uint64_t b = 2 * static_cast<uint64_t>(size - 1) * n / static_cast<uint64_t>(size);
  return {b, b};
}

Bytes broadcast(uint64_t n, int rank, int size, int root) {
  const int v = (rank - root + size) % size;
  return {n * tree_children(v, size), v == 0 ? 0 : n};
}

Bytes reduce(uint64_t n, int rank, int size, int root) {
  auto b = broadcast(n, rank, size, root);
  return {b.received, b.sent};
}

Bytes all_gather(uint64_t per_rank, int, int size) {
  const uint64_t b = static_cast<uint64_t>(size - 1) * per_rank;
  return {b, b};
}

Bytes reduce_scatter(uint64_t per_rank, int rank, int size) {
  return all_gather(per_rank, rank, size);
}

}  // namespace wire_model

// --- the decorator -------------------------------------------------------

CountingEngine::CountingEngine(std::unique_ptr<Engine> inner,
                               std::shared_ptr<StatsCounters> counters)
    : inner_(std::move(inner)), counters_(std::move(counters)) {}

std::unique_ptr<Engine> CountingEngine::wrap(std::unique_ptr<Engine> engine,
                                             std::shared_ptr<StatsCounters> counters) {
  if (auto* counting = dynamic_cast<CountingEngine*>(engine.get())) {
    engine = std::move(counting->inner_);
  }
  return std::make_unique<CountingEngine>(std::move(engine), std::move(counters));
}

void CountingEngine::count(uint64_t sent, uint64_t received) {
  auto& k = (*counters_)[t_current];
  if (sent) k.sent.fetch_add(sent, std::memory_order_relaxed);
  if (received) k.received.fetch_add(received, std::memory_order_relaxed);
}

WorkPtr CountingEngine::all_reduce(at::Tensor& tensor, ReduceOp op) {
  auto b = wire_model::all_reduce(bytes_of(tensor), rank(), size());
  count(b.sent, b.received);
  return inner_->all_reduce(tensor, op);
}

WorkPtr CountingEngine::broadcast(at::Tensor& tensor, int root) {
  auto b = wire_model::broadcast(bytes_of(tensor), rank(), size(), root);
  count(b.sent, b.received);
  return inner_->broadcast(tensor, root);
}

WorkPtr CountingEngine::reduce(at::Tensor& tensor, int root, ReduceOp op) {
  auto b = wire_model::reduce(bytes_of(tensor), rank(), size(), root);
  count(b.sent, b.received);
  return inner_->reduce(tensor, root, op);
}

WorkPtr CountingEngine::all_gather(std::vector<at::Tensor>& outputs, at::Tensor& input) {
  auto b = wire_model::all_gather(bytes_of(input), rank(), size());
  count(b.sent, b.received);
  return inner_->all_gather(outputs, input);
}

WorkPtr CountingEngine::reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs,
                                       ReduceOp op) {
  // Without its own, the engine all-reduces the concatenated inputs.
  const uint64_t per_rank = bytes_of(output);
  auto b = inner_->has_native_reduce_scatter()
               ? wire_model::reduce_scatter(per_rank, rank(), size())
               : wire_model::all_reduce(per_rank * static_cast<uint64_t>(size()), rank(), size());
  count(b.sent, b.received);
  return inner_->reduce_scatter(output, inputs, op);
}

WorkPtr CountingEngine::gather(std::vector<at::Tensor>& outputs, at::Tensor& input, int root) {
  const uint64_t m = bytes_of(input);
  if (rank() == root) {
    count(0, m * static_cast<uint64_t>(size() - 1));
  } else {
    count(m, 0);
  }
  return inner_->gather(outputs, input, root);
}

WorkPtr CountingEngine::scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, int root) {
  if (rank() == root) {
    uint64_t sent = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
      if (static_cast<int>(i) != root) sent += bytes_of(inputs[i]);
    }
    count(sent, 0);
  } else {
    count(0, bytes_of(output));
  }
  return inner_->scatter(output, inputs, root);
}

WorkPtr CountingEngine::all_to_all(at::Tensor& output, at::Tensor& input,
                                   std::vector<int64_t>& output_counts,
                                   std::vector<int64_t>& input_counts) {
  // Every block but the rank's own leaves (or arrives); empty counts are
  // equal splits.
  auto moved = [&](const at::Tensor& t, const std::vector<int64_t>& counts) -> uint64_t {
    const int64_t own = counts.empty() ? t.numel() / size() : counts[rank()];
    return static_cast<uint64_t>(t.numel() - own) * static_cast<uint64_t>(t.element_size());
  };
  count(moved(input, input_counts), moved(output, output_counts));
  return inner_->all_to_all(output, input, output_counts, input_counts);
}

WorkPtr CountingEngine::send(at::Tensor& tensor, int dst, int tag) {
  count(bytes_of(tensor), 0);
  return inner_->send(tensor, dst, tag);
}

WorkPtr CountingEngine::recv(at::Tensor& tensor, int src, int tag) {
  count(0, bytes_of(tensor));
  return inner_->recv(tensor, src, tag);
}

std::unique_ptr<Engine> CountingEngine::create_subgroup(const std::vector<int>& ranks,
                                                        std::shared_ptr<Store> store,
                                                        Millis timeout) {
  return std::make_unique<CountingEngine>(inner_->create_subgroup(ranks, std::move(store), timeout),
                                          counters_);
}

// --- timing a Work -------------------------------------------------------

namespace {

uint64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count());
}

std::chrono::steady_clock::time_point steady_at(uint64_t ns) {
  return std::chrono::steady_clock::time_point(
      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
          std::chrono::nanoseconds(ns)));
}

// Times completion and waits on tick_clock, or on steady_clock when traced
// (the trace's events need steady_clock times, and the trace's totals must
// equal the counters).
class TrackedWork : public WorkImpl {
 public:
  TrackedWork(WorkPtr inner, std::shared_ptr<StatsCounters> counters, OpKind kind,
              uint64_t issued_ticks, OpTrace trace)
      : inner_(std::move(inner)),
        counters_(std::move(counters)),
        kind_(kind),
        traced_(active(trace.tracer) != nullptr),
        issued_(traced_ ? steady_ns(trace.issued) : issued_ticks),
        trace_(std::move(trace)) {}

  bool is_completed() override {
    if (!inner_->is_completed()) return false;
    completed(read());
    return true;
  }

  void wait(Millis timeout) override {
    const uint64_t start = read();
    inner_->wait(timeout);
    const uint64_t end = read();
    (*counters_)[kind_].waiting_ns.fetch_add(to_ns(end - start), std::memory_order_relaxed);
    if (Tracer* t = active(trace_.tracer)) {
      t->complete(std::string("wait ") + to_string(kind_), "comm.wait", steady_at(start),
                  steady_at(end), {TraceArg::num("id", static_cast<double>(trace_.id))});
    }
    completed(end);
  }

 private:
  uint64_t read() const {
    return traced_ ? steady_ns(std::chrono::steady_clock::now()) : tick_clock::now();
  }
  uint64_t to_ns(uint64_t d) const { return traced_ ? d : tick_clock::to_ns(d); }

  // Once per operation (a Work is waited for by one thread at a time).
  void completed(uint64_t at) {
    if (done_.exchange(true, std::memory_order_relaxed)) return;
    auto& k = (*counters_)[kind_];
    k.completed.fetch_add(1, std::memory_order_relaxed);
    k.in_flight_ns.fetch_add(to_ns(at - issued_), std::memory_order_relaxed);
    if (Tracer* t = active(trace_.tracer)) {
      t->async_span(to_string(kind_), "comm.flight", trace_.id, trace_.issued, steady_at(at),
                    std::move(trace_.args));
    }
  }

  WorkPtr inner_;
  std::shared_ptr<StatsCounters> counters_;
  OpKind kind_;
  bool traced_;
  uint64_t issued_;  // on read()'s clock
  OpTrace trace_;
  std::atomic<bool> done_{false};
};

}  // namespace

WorkPtr track(WorkPtr impl, std::shared_ptr<StatsCounters> counters, OpKind kind,
              uint64_t issued_ticks, OpTrace trace) {
  auto& k = (*counters)[kind];
  k.calls.fetch_add(1, std::memory_order_relaxed);
  // An operation the engine finished at issue (MPI's blocking path for small
  // messages) has no flight or wait left to time: count it now and return it
  // unwrapped. That saves an allocation per call, a measurable share of a
  // 1 KiB MPI all_reduce. A trace still wraps it, for its wait event.
  if (active(trace.tracer) == nullptr && impl->is_completed()) {
    k.completed.fetch_add(1, std::memory_order_relaxed);
    k.in_flight_ns.fetch_add(tick_clock::to_ns(tick_clock::now() - issued_ticks),
                             std::memory_order_relaxed);
    return impl;
  }
  return std::make_shared<TrackedWork>(std::move(impl), std::move(counters), kind, issued_ticks,
                                       std::move(trace));
}

}  // namespace cohort
