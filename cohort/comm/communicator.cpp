#include "cohort/comm/communicator.h"

#include <algorithm>
#include <numeric>

#include "cohort/algorithms/executor.h"
#include "cohort/comm/collective_checker.h"
#include "cohort/comm/counting_engine.h"
#include "cohort/comm/env.h"
#include "cohort/comm/error.h"
#include "cohort/comm/tensor_checks.h"
#include "cohort/comm/work_then.h"

namespace cohort {

struct Communicator::Health {
  std::mutex mu;
  bool broken = false;
  std::string reason;
};

Communicator::Communicator(std::unique_ptr<Engine> engine, std::shared_ptr<Store> store,
                           CommunicatorOptions options)
    : counters_(std::make_shared<StatsCounters>()),
      engine_(CountingEngine::wrap(std::move(engine), counters_)),
      store_(std::move(store)),
      options_(std::move(options)),
      rank_(engine_->rank()),
      size_(engine_->size()),
      health_(std::make_shared<Health>()) {
  if (options_.debug_checks) {
    checker_ = std::make_unique<CollectiveChecker>(store_, rank_, size_);
  }
  if (options_.algorithm == Algorithm::Default) {
    options_.algorithm = Algorithm::Engine;
    if (auto name = env::get("COHORT_ALGO")) {
      auto a = parse_algorithm(*name);
      if (!a || *a == Algorithm::Default) {
        throw ConfigError("cohort: COHORT_ALGO='" + *name +
                          "' is not one of engine, ring, tree, hd, hierarchical, adaptive");
      }
      options_.algorithm = *a;
    }
  }
  if (options_.calibration_max_bytes <= 0) {
    options_.calibration_max_bytes =
        env::get_int("COHORT_CALIBRATION_MAX_BYTES", 1024, 1 << 30).value_or(64 << 20);
  }
  // Construction is collective, so a communicator whose default is an
  // algorithm builds its private engine here; built lazily, a rank whose
  // peers never call would block inside the call rather than time out in
  // wait(). (A per-call algo on an engine-default communicator still builds
  // it at that call, which every rank reaches in the same order.)
  if (options_.algorithm != Algorithm::Engine) algorithms();
}

Communicator::~Communicator() = default;

CommStats Communicator::stats() const { return counters_->snapshot(); }

void Communicator::reset_stats() { counters_->reset(); }

algorithms::Executor& Communicator::algorithms() {
  if (!algorithms_) {
    algorithms::Executor::Options o;
    o.timeout = options_.timeout;
    o.node = options_.node;
    o.calibration_max_bytes = options_.calibration_max_bytes;
    algorithms_ = std::make_unique<algorithms::Executor>(*engine_, store_, o);
  }
  return *algorithms_;
}

Algorithm Communicator::resolve_algorithm(Collective op, int64_t bytes, Algorithm requested) {
  const Algorithm a = requested == Algorithm::Default ? options_.algorithm : requested;
  if (a == Algorithm::Engine) {
    // Gloo 1.13 has no reduce_scatter: the engine's fallback all-reduces the
    // whole input (twice a ring's traffic), so its "native" choice is the ring.
    if (op == Collective::ReduceScatter && size_ > 1 && !engine_->has_native_reduce_scatter()) {
      return Algorithm::Ring;
    }
    return a;
  }
  return algorithms().resolve(op, a, bytes);
}

std::string Communicator::describe_cost_model(Collective op) {
  const auto& c = algorithms().calibration(op);
  std::string s = to_string(op) + " calibrated in " +
                  std::to_string(static_cast<int>(c.seconds * 1000)) + " ms; model (bytes:us, smoothed): " +
                  c.model.serialize() + " samples (algo bytes us):";
  for (auto& x : c.samples) {
    s += " " + to_string(x.algo) + " " + std::to_string(static_cast<int64_t>(x.bytes)) + " " +
         std::to_string(x.us) + ";";
  }
  return s;
}

Communicator::Call Communicator::begin(const std::string& op, Millis timeout,
                                       std::vector<int> peers) const {
  Call call;
  call.ctx.op = op;
  call.ctx.group = options_.name;
  call.ctx.rank = rank_;
  call.ctx.size = size_;
  call.ctx.peers = std::move(peers);
  // Engine traffic from here to the next operation counts under this kind.
  call.kind = op_kind_from_name(op);
  call.issued = std::chrono::steady_clock::now();
  set_current_op_kind(call.kind);
  call.ctx.timeout = timeout == kDefaultTimeout ? options_.timeout : timeout;
  if (call.ctx.timeout.count() <= 0) {
    throw InvalidArgument("cohort: " + call.where() + ": timeout must be positive, got " +
                          std::to_string(call.ctx.timeout.count()) + " ms");
  }
  std::lock_guard<std::mutex> lock(health_->mu);
  if (health_->broken) {
    throw PeerError("cohort: " + call.where() +
                    ": refused, this communicator failed earlier: " + health_->reason);
  }
  return call;
}

Communicator::Call Communicator::begin_collective(const std::string& op,
                                                  Millis timeout) const {
  auto call = begin(op, timeout, {});
  call.ctx.all_peers = true;
  return call;
}

void Communicator::debug_check(const Call& call, const std::string& fingerprint) {
  if (!checker_) return;
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
  impl = track(std::move(impl), counters_, call.kind, call.issued);
  return Work(std::move(impl), call.ctx, std::move(on_success),
              [health](const std::string& why) {
                std::lock_guard<std::mutex> lock(health->mu);
                if (!health->broken) {
                  health->broken = true;
                  health->reason = why;
                }
              });
}

void Communicator::check_root(const Call& call, int root) const {
  if (root < 0 || root >= size_) {
    throw InvalidArgument("cohort: " + call.where() + ": root " + std::to_string(root) +
                          " is outside the group of " + std::to_string(size_));
  }
}

void Communicator::check_peer(const Call& call, int peer) const {
  if (peer < 0 || peer >= size_ || peer == rank_) {
    throw InvalidArgument("cohort: " + call.where() + ": peer " + std::to_string(peer) +
                          " is not another rank of the group of " + std::to_string(size_));
  }
}

namespace {

std::string fingerprint(const std::string& op, const torch::Tensor& t,
                        const std::string& extra = {}) {
  std::string s = op + "(";
  if (!extra.empty()) s += extra + ", ";
  return s + "dtype=" + dtype_name(t.scalar_type()) + ", shape=" + shape_string(t.sizes()) +
         ")";
}

void check_avg(const OpContext& ctx, const torch::Tensor& t, ReduceOp op) {
  if (op == ReduceOp::Avg && !at::isFloatingType(t.scalar_type())) {
    throw InvalidArgument("cohort: " + ctx.describe() + ": avg needs a floating-point dtype, got " +
                          dtype_name(t.scalar_type()));
  }
}

ReduceOp engine_op(ReduceOp op) { return op == ReduceOp::Avg ? ReduceOp::Sum : op; }

// The tensor a reduction runs on: the caller's own tensor when its dtype
// reduces natively, else an f32 copy that is copied back afterwards.
torch::Tensor reduction_buffer(const torch::Tensor& t) {
  auto dt = reduction_dtype(t.scalar_type());
  return dt == t.scalar_type() ? t : t.to(dt);
}

// After a reduction into `buf`: average, then copy into `out` if they differ.
void finish_reduction(torch::Tensor& out, torch::Tensor& buf, ReduceOp op, int size) {
  if (op == ReduceOp::Avg) buf.div_(size);
  if (!buf.is_same(out)) out.copy_(buf);
}

std::vector<torch::Tensor> flat_chunks(const torch::Tensor& flat, int64_t n, int count,
                                       at::IntArrayRef shape) {
  std::vector<torch::Tensor> chunks;
  chunks.reserve(static_cast<size_t>(count));
  for (int i = 0; i < count; ++i) chunks.push_back(flat.narrow(0, i * n, n).view(shape));
  return chunks;
}

}  // namespace

Work Communicator::all_reduce(torch::Tensor& tensor, const AllReduceOptions& opts) {
  auto call = begin_collective("all_reduce", opts.timeout);
  check_tensor(tensor, call.ctx, "tensor");
  check_avg(call.ctx, tensor, opts.op);
  if (checker_) debug_check(call, fingerprint("all_reduce", tensor, "op=" + to_string(opts.op)));
  // Alone, every reduction (avg included) is the identity: no engine round
  // trip, no pass over the data (DDP at world 1 calls this every step).
  if (tensor.numel() == 0 || size_ == 1) return finish(call, done_work());
  auto buf = reduction_buffer(tensor);
  const auto algo = resolve_algorithm(Collective::AllReduce, buf.numel() * buf.element_size(),
                                      opts.algo);
  auto impl = algo == Algorithm::Engine
                  ? engine_->all_reduce(buf, engine_op(opts.op))
                  : algorithms().all_reduce(buf.view({-1}), engine_op(opts.op), algo,
                                            call.ctx.timeout);
  return finish(call, std::move(impl), [tensor, buf, op = opts.op, n = size_]() mutable {
    finish_reduction(tensor, buf, op, n);
  });
}

Work Communicator::all_reduce_coalesced(std::vector<torch::Tensor>& tensors,
                                        const AllReduceOptions& opts) {
  auto call = begin_collective("all_reduce_coalesced", opts.timeout);
  std::string print = "all_reduce_coalesced(op=" + to_string(opts.op);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_tensor(tensors[i], call.ctx, "tensors[" + std::to_string(i) + "]");
    check_avg(call.ctx, tensors[i], opts.op);
    print += ", " + dtype_name(tensors[i].scalar_type()) + shape_string(tensors[i].sizes());
  }
  if (checker_) debug_check(call, print + ")");

  // One flat buffer per reduction dtype, in order of first appearance, which
  // is the same on every rank because the tensor lists match.
  std::vector<at::ScalarType> dtypes;
  for (auto& t : tensors) {
    auto dt = reduction_dtype(t.scalar_type());
    if (std::find(dtypes.begin(), dtypes.end(), dt) == dtypes.end()) dtypes.push_back(dt);
  }
  std::vector<WorkPtr> parts;
  std::vector<std::pair<torch::Tensor, std::vector<size_t>>> flats;
  for (auto dt : dtypes) {
    std::vector<size_t> members;
    std::vector<torch::Tensor> pieces;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (reduction_dtype(tensors[i].scalar_type()) != dt || tensors[i].numel() == 0) continue;
      members.push_back(i);
      pieces.push_back(tensors[i].reshape({-1}).to(dt));
    }
    if (members.empty()) continue;
    auto flat = at::cat(pieces);
    parts.push_back(engine_->all_reduce(flat, engine_op(opts.op)));
    flats.emplace_back(flat, std::move(members));
  }
  auto copy_back = [tensors, flats, op = opts.op, n = size_]() mutable {
    for (auto& [flat, members] : flats) {
      if (op == ReduceOp::Avg) flat.div_(n);
      int64_t offset = 0;
      for (size_t i : members) {
        auto& t = tensors[i];
        t.view({-1}).copy_(flat.narrow(0, offset, t.numel()));
        offset += t.numel();
      }
    }
  };
  return finish(call, std::make_shared<WorkList>(std::move(parts)), std::move(copy_back));
}

Work Communicator::broadcast(torch::Tensor& tensor, const BroadcastOptions& opts) {
  auto call = begin_collective("broadcast", opts.timeout);
  check_root(call, opts.root);
  check_tensor(tensor, call.ctx, "tensor");
  if (checker_) debug_check(call, fingerprint("broadcast", tensor, "root=" + std::to_string(opts.root)));
  if (tensor.numel() == 0) return finish(call, done_work());
  auto wire = movement_view(tensor);
  return finish(call, engine_->broadcast(wire, opts.root));
}

Work Communicator::broadcast_coalesced(std::vector<torch::Tensor>& tensors,
                                       const BroadcastOptions& opts) {
  auto call = begin_collective("broadcast_coalesced", opts.timeout);
  check_root(call, opts.root);
  std::string print = "broadcast_coalesced(root=" + std::to_string(opts.root);
  for (size_t i = 0; i < tensors.size(); ++i) {
    check_tensor(tensors[i], call.ctx, "tensors[" + std::to_string(i) + "]");
    print += ", " + dtype_name(tensors[i].scalar_type()) + shape_string(tensors[i].sizes());
  }
  if (checker_) debug_check(call, print + ")");
  // Bytes are bytes: one flat uint8 buffer carries every dtype at once.
  int64_t total = 0;
  for (auto& t : tensors) total += t.numel() * t.element_size();
  if (total == 0) return finish(call, done_work());
  auto flat = torch::empty({total}, torch::kUInt8);
  if (rank_ == opts.root) {
    int64_t offset = 0;
    for (auto& t : tensors) {
      const int64_t n = t.numel() * t.element_size();
      flat.narrow(0, offset, n).copy_(t.view({-1}).view(torch::kUInt8));
      offset += n;
    }
  }
  auto impl = engine_->broadcast(flat, opts.root);
  auto copy_back = [tensors, flat, root = opts.root, me = rank_]() mutable {
    if (me == root) return;
    int64_t offset = 0;
    for (auto& t : tensors) {
      const int64_t n = t.numel() * t.element_size();
      t.view({-1}).view(torch::kUInt8).copy_(flat.narrow(0, offset, n));
      offset += n;
    }
  };
  return finish(call, std::move(impl), std::move(copy_back));
}

Work Communicator::reduce(torch::Tensor& tensor, const ReduceOptions& opts) {
  auto call = begin_collective("reduce", opts.timeout);
  check_root(call, opts.root);
  check_tensor(tensor, call.ctx, "tensor");
  check_avg(call.ctx, tensor, opts.op);
  if (checker_) debug_check(call, fingerprint("reduce", tensor,
                                "root=" + std::to_string(opts.root) + ", op=" + to_string(opts.op)));
  if (tensor.numel() == 0) return finish(call, done_work());
  auto buf = reduction_buffer(tensor);
  auto impl = engine_->reduce(buf, opts.root, engine_op(opts.op));
  const bool is_root = rank_ == opts.root;
  return finish(call, std::move(impl),
                [tensor, buf, op = opts.op, n = size_, is_root]() mutable {
                  if (is_root) finish_reduction(tensor, buf, op, n);
                });
}

Work Communicator::all_gather(std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
                              const AllGatherOptions& opts) {
  auto call = begin_collective("all_gather", opts.timeout);
  check_tensor(input, call.ctx, "input");
  if (static_cast<int>(outputs.size()) != size_) {
    throw InvalidArgument("cohort: " + call.where() + ": outputs has " +
                          std::to_string(outputs.size()) + " tensors, expected one per rank (" +
                          std::to_string(size_) + ")");
  }
  for (size_t i = 0; i < outputs.size(); ++i) {
    check_like(outputs[i], input, call.ctx, "outputs[" + std::to_string(i) + "]");
  }
  if (checker_) debug_check(call, fingerprint("all_gather", input));
  if (input.numel() == 0) return finish(call, done_work());
  std::vector<torch::Tensor> wire_out;
  for (auto& o : outputs) wire_out.push_back(movement_view(o));
  auto wire_in = movement_view(input);
  const auto algo = resolve_algorithm(
      Collective::AllGather, size_ * input.numel() * input.element_size(), opts.algo);
  if (algo != Algorithm::Engine) {
    // Gathered flat, then copied out: the algorithms work on one buffer.
    auto flat = torch::empty({size_ * input.numel()}, wire_in.options());
    auto impl = algorithms().all_gather(flat, wire_in.reshape({-1}), algo, call.ctx.timeout);
    return finish(call, std::move(impl), [wire_out, flat, n = input.numel()]() mutable {
      for (size_t i = 0; i < wire_out.size(); ++i) {
        wire_out[i].view({-1}).copy_(flat.narrow(0, static_cast<int64_t>(i) * n, n));
      }
    });
  }
  return finish(call, engine_->all_gather(wire_out, wire_in));
}

Work Communicator::all_gather_into_tensor(torch::Tensor& output, const torch::Tensor& input,
                                          const AllGatherOptions& opts) {
  auto call = begin_collective("all_gather_into_tensor", opts.timeout);
  check_tensor(input, call.ctx, "input");
  check_tensor(output, call.ctx, "output");
  if (output.scalar_type() != input.scalar_type() || output.numel() != input.numel() * size_) {
    throw InvalidArgument("cohort: " + call.where() + ": output (" +
                          dtype_name(output.scalar_type()) + shape_string(output.sizes()) +
                          ") must have the input's dtype and " + std::to_string(size_) +
                          " times its " + std::to_string(input.numel()) + " elements");
  }
  if (checker_) debug_check(call, fingerprint("all_gather_into_tensor", input));
  if (input.numel() == 0) return finish(call, done_work());
  auto wire_in = movement_view(input);
  const auto algo = resolve_algorithm(
      Collective::AllGather, output.numel() * output.element_size(), opts.algo);
  if (algo != Algorithm::Engine) {
    return finish(call, algorithms().all_gather(movement_view(output).view({-1}),
                                                wire_in.reshape({-1}), algo, call.ctx.timeout));
  }
  auto chunks = flat_chunks(movement_view(output).view({-1}), input.numel(), size_,
                            input.sizes());
  return finish(call, engine_->all_gather(chunks, wire_in));
}

Work Communicator::reduce_scatter(torch::Tensor& output,
                                  const std::vector<torch::Tensor>& inputs,
                                  const ReduceScatterOptions& opts) {
  auto call = begin_collective("reduce_scatter", opts.timeout);
  check_tensor(output, call.ctx, "output");
  check_avg(call.ctx, output, opts.op);
  if (static_cast<int>(inputs.size()) != size_) {
    throw InvalidArgument("cohort: " + call.where() + ": inputs has " +
                          std::to_string(inputs.size()) + " tensors, expected one per rank (" +
                          std::to_string(size_) + ")");
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    check_like(inputs[i], output, call.ctx, "inputs[" + std::to_string(i) + "]");
  }
  if (checker_) debug_check(call, fingerprint("reduce_scatter", output, "op=" + to_string(opts.op)));
  if (output.numel() == 0) return finish(call, done_work());
  auto buf = reduction_buffer(output);
  std::vector<torch::Tensor> wire_in;
  for (auto& t : inputs) wire_in.push_back(reduction_buffer(t));
  const auto algo = resolve_algorithm(
      Collective::ReduceScatter, size_ * buf.numel() * buf.element_size(), opts.algo);
  std::vector<torch::Tensor> flat_in;
  if (algo != Algorithm::Engine) {
    for (auto& t : wire_in) flat_in.push_back(t.reshape({-1}));
  }
  auto impl = algo == Algorithm::Engine
                  ? engine_->reduce_scatter(buf, wire_in, engine_op(opts.op))
                  : algorithms().reduce_scatter(buf.view({-1}), at::cat(flat_in),
                                                engine_op(opts.op), algo, call.ctx.timeout);
  return finish(call, std::move(impl), [output, buf, op = opts.op, n = size_]() mutable {
    finish_reduction(output, buf, op, n);
  });
}

Work Communicator::reduce_scatter_tensor(torch::Tensor& output, const torch::Tensor& input,
                                         const ReduceScatterOptions& opts) {
  auto call = begin_collective("reduce_scatter_tensor", opts.timeout);
  check_tensor(output, call.ctx, "output");
  check_tensor(input, call.ctx, "input");
  check_avg(call.ctx, output, opts.op);
  if (output.scalar_type() != input.scalar_type() || input.numel() != output.numel() * size_) {
    throw InvalidArgument("cohort: " + call.where() + ": input (" +
                          dtype_name(input.scalar_type()) + shape_string(input.sizes()) +
                          ") must have the output's dtype and " + std::to_string(size_) +
                          " times its " + std::to_string(output.numel()) + " elements");
  }
  if (checker_) debug_check(call, fingerprint("reduce_scatter_tensor", output, "op=" + to_string(opts.op)));
  if (output.numel() == 0) return finish(call, done_work());
  auto buf = reduction_buffer(output);
  const auto algo = resolve_algorithm(
      Collective::ReduceScatter, input.numel() * buf.element_size(), opts.algo);
  if (algo != Algorithm::Engine) {
    auto impl = algorithms().reduce_scatter(buf.view({-1}), reduction_buffer(input).view({-1}),
                                            engine_op(opts.op), algo, call.ctx.timeout);
    return finish(call, std::move(impl), [output, buf, op = opts.op, n = size_]() mutable {
      finish_reduction(output, buf, op, n);
    });
  }
  auto wire_in = flat_chunks(reduction_buffer(input).view({-1}), output.numel(), size_,
                             output.sizes());
  auto impl = engine_->reduce_scatter(buf, wire_in, engine_op(opts.op));
  return finish(call, std::move(impl), [output, buf, op = opts.op, n = size_]() mutable {
    finish_reduction(output, buf, op, n);
  });
}

Work Communicator::gather(std::vector<torch::Tensor>& outputs, const torch::Tensor& input,
                          const GatherOptions& opts) {
  auto call = begin_collective("gather", opts.timeout);
  check_root(call, opts.root);
  check_tensor(input, call.ctx, "input");
  const bool is_root = rank_ == opts.root;
  if (is_root) {
    if (static_cast<int>(outputs.size()) != size_) {
      throw InvalidArgument("cohort: " + call.where() + ": outputs has " +
                            std::to_string(outputs.size()) +
                            " tensors on the root, expected one per rank (" +
                            std::to_string(size_) + ")");
    }
    for (size_t i = 0; i < outputs.size(); ++i) {
      check_like(outputs[i], input, call.ctx, "outputs[" + std::to_string(i) + "]");
    }
  }
  if (checker_) debug_check(call, fingerprint("gather", input, "root=" + std::to_string(opts.root)));
  if (input.numel() == 0) return finish(call, done_work());
  std::vector<torch::Tensor> wire_out;
  if (is_root) {
    for (auto& o : outputs) wire_out.push_back(movement_view(o));
  }
  auto wire_in = movement_view(input);
  return finish(call, engine_->gather(wire_out, wire_in, opts.root));
}

Work Communicator::scatter(torch::Tensor& output, const std::vector<torch::Tensor>& inputs,
                           const ScatterOptions& opts) {
  auto call = begin_collective("scatter", opts.timeout);
  check_root(call, opts.root);
  check_tensor(output, call.ctx, "output");
  const bool is_root = rank_ == opts.root;
  if (is_root) {
    if (static_cast<int>(inputs.size()) != size_) {
      throw InvalidArgument("cohort: " + call.where() + ": inputs has " +
                            std::to_string(inputs.size()) +
                            " tensors on the root, expected one per rank (" +
                            std::to_string(size_) + ")");
    }
    for (size_t i = 0; i < inputs.size(); ++i) {
      check_like(inputs[i], output, call.ctx, "inputs[" + std::to_string(i) + "]");
    }
  }
  if (checker_) debug_check(call, fingerprint("scatter", output, "root=" + std::to_string(opts.root)));
  if (output.numel() == 0) return finish(call, done_work());
  std::vector<torch::Tensor> wire_in;
  if (is_root) {
    for (auto& t : inputs) wire_in.push_back(movement_view(t));
  }
  auto wire_out = movement_view(output);
  return finish(call, engine_->scatter(wire_out, wire_in, opts.root));
}

Work Communicator::all_to_all_single(torch::Tensor& output, const torch::Tensor& input,
                                     std::vector<int64_t> output_split_sizes,
                                     std::vector<int64_t> input_split_sizes,
                                     const AllToAllOptions& opts) {
  auto call = begin_collective("all_to_all_single", opts.timeout);
  check_tensor(input, call.ctx, "input");
  check_tensor(output, call.ctx, "output");
  auto bad = [&](const std::string& why) {
    throw InvalidArgument("cohort: " + call.where() + ": " + why);
  };
  if (output.scalar_type() != input.scalar_type()) bad("output and input dtypes differ");
  if (input.dim() == 0 || output.dim() == 0) bad("tensors need at least one dimension");
  if (input.sizes().slice(1) != output.sizes().slice(1)) {
    bad("output and input differ beyond dim 0: " + shape_string(output.sizes()) + " vs " +
        shape_string(input.sizes()));
  }
  const int64_t row = input.numel() / std::max<int64_t>(input.size(0), 1);
  auto counts = [&](std::vector<int64_t>& splits, const torch::Tensor& t,
                    const std::string& name) {
    if (splits.empty()) {
      if (t.size(0) % size_ != 0) {
        bad(name + " has " + std::to_string(t.size(0)) + " rows, not divisible by " +
            std::to_string(size_) + "; pass split sizes");
      }
      splits.assign(static_cast<size_t>(size_), t.size(0) / size_);
    }
    if (static_cast<int>(splits.size()) != size_) bad(name + " split sizes need one entry per rank");
    if (std::accumulate(splits.begin(), splits.end(), int64_t{0}) != t.size(0) ||
        std::any_of(splits.begin(), splits.end(), [](int64_t s) { return s < 0; })) {
      bad(name + " split sizes do not add up to its " + std::to_string(t.size(0)) + " rows");
    }
    std::vector<int64_t> elements;
    for (auto s : splits) elements.push_back(s * row);
    return elements;
  };
  auto out_counts = counts(output_split_sizes, output, "output");
  auto in_counts = counts(input_split_sizes, input, "input");
  if (checker_) debug_check(call, "all_to_all_single(dtype=" + dtype_name(input.scalar_type()) + ", row=" +
                        shape_string(input.sizes().slice(1)) + ")");
  auto wire_out = movement_view(output).view({-1});
  auto wire_in = movement_view(input).view({-1});
  return finish(call, engine_->all_to_all(wire_out, wire_in, out_counts, in_counts));
}

Work Communicator::all_to_all(std::vector<torch::Tensor>& outputs,
                              const std::vector<torch::Tensor>& inputs,
                              const AllToAllOptions& opts) {
  auto call = begin_collective("all_to_all", opts.timeout);
  if (static_cast<int>(outputs.size()) != size_ || static_cast<int>(inputs.size()) != size_) {
    throw InvalidArgument("cohort: " + call.where() + ": needs one input and one output per rank (" +
                          std::to_string(size_) + "), got " + std::to_string(inputs.size()) +
                          " and " + std::to_string(outputs.size()));
  }
  std::string print = "all_to_all(";
  for (int i = 0; i < size_; ++i) {
    check_tensor(inputs[i], call.ctx, "inputs[" + std::to_string(i) + "]");
    check_tensor(outputs[i], call.ctx, "outputs[" + std::to_string(i) + "]");
    if (inputs[i].scalar_type() != inputs[0].scalar_type() ||
        outputs[i].scalar_type() != inputs[0].scalar_type()) {
      throw InvalidArgument("cohort: " + call.where() + ": all inputs and outputs need one dtype");
    }
    print += (i ? ", " : "") + shape_string(inputs[i].sizes());
  }
  if (checker_) debug_check(call, print + ")");
  std::vector<torch::Tensor> flat_in;
  std::vector<int64_t> in_counts, out_counts;
  int64_t out_total = 0;
  for (int i = 0; i < size_; ++i) {
    flat_in.push_back(movement_view(inputs[i]).reshape({-1}));
    in_counts.push_back(inputs[i].numel());
    out_counts.push_back(outputs[i].numel());
    out_total += outputs[i].numel();
  }
  auto wire_in = at::cat(flat_in);
  auto wire_out = torch::empty({out_total}, wire_in.options());
  auto impl = engine_->all_to_all(wire_out, wire_in, out_counts, in_counts);
  return finish(call, std::move(impl), [outputs, wire_out]() mutable {
    int64_t offset = 0;
    for (auto& o : outputs) {
      movement_view(o).view({-1}).copy_(wire_out.narrow(0, offset, o.numel()));
      offset += o.numel();
    }
  });
}

Work Communicator::barrier(const BarrierOptions& opts) {
  auto call = begin_collective("barrier", opts.timeout);
  if (checker_) debug_check(call, "barrier()");
  return finish(call, engine_->barrier());
}

Work Communicator::send(const torch::Tensor& tensor, int dst, const SendOptions& opts) {
  auto call = begin("send", opts.timeout, {dst});
  check_peer(call, dst);
  check_tensor(tensor, call.ctx, "tensor");
  if (opts.tag < 0) throw InvalidArgument("cohort: " + call.where() + ": tag must be >= 0");
  auto wire = movement_view(tensor);
  return finish(call, engine_->send(wire, dst, opts.tag));
}

Work Communicator::recv(torch::Tensor& tensor, int src, const RecvOptions& opts) {
  auto call = begin("recv", opts.timeout, {src});
  check_peer(call, src);
  check_tensor(tensor, call.ctx, "tensor");
  if (opts.tag < 0) throw InvalidArgument("cohort: " + call.where() + ": tag must be >= 0");
  auto wire = movement_view(tensor);
  return finish(call, engine_->recv(wire, src, opts.tag));
}

}  // namespace cohort
