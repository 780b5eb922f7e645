#include "cohort/algorithms/executor.h"

#include "cohort/algorithms/double_binary_tree.h"
#include "cohort/algorithms/halving_doubling.h"
#include "cohort/algorithms/ring.h"
#include "cohort/core/error.h"
#include "cohort/core/serial_worker.h"
#include "cohort/core/store/prefix_store.h"
#include "cohort/observability/counting_engine.h"

namespace cohort::algorithms {
namespace {

std::vector<at::Tensor> chunks(const at::Tensor& flat, int parts) {
  const int64_t each = flat.numel() / parts;
  std::vector<at::Tensor> out;
  for (int i = 0; i < parts; ++i) out.push_back(flat.narrow(0, i * each, each));
  return out;
}

}  // namespace

Executor::Executor(Engine& parent, const std::shared_ptr<Store>& store, CommunicatorOptions options)
    : options_(std::move(options)),
      store_(std::make_shared<PrefixStore>("algo", store)),
      parent_(parent) {
  std::vector<int> all(static_cast<size_t>(parent.size()));
  for (int r = 0; r < parent.size(); ++r) all[static_cast<size_t>(r)] = r;
  engine_ = parent.create_subgroup(all, store_, options_.timeout);
  SerialWorker::Options worker;
  worker.refusal = "an earlier algorithm operation failed";
  worker_ = std::make_unique<SerialWorker>(std::move(worker));
}

// The worker goes first (its destructor runs the jobs already issued: the
// peers expect them), while the engine and scratch its jobs use still exist.
Executor::~Executor() { worker_.reset(); }

WorkPtr Executor::submit(std::string what, Millis timeout, Job job) {
  const auto deadline = Clock::now() + timeout;
  // The job's traffic counts under the operation that issued it.
  return worker_->submit(what, deadline,
                         [this, what, deadline, job = std::move(job), kind = current_op_kind()] {
                           OpKindScope counted_as(kind);
                           EnginePointToPoint transport(*engine_);
                           Link link(transport, what, deadline, &scratch_);
                           job(link);
                         });
}

std::vector<Algorithm> Executor::candidates(Collective op) {
  std::vector<Algorithm> c{Algorithm::Engine, Algorithm::Ring, Algorithm::HalvingDoubling};
  if (op == Collective::AllReduce) {
    c.push_back(Algorithm::Tree);
    // On one node it is the engine's reduce then its broadcast, which at
    // world 4 on this 2-core machine beat the engine's all_reduce at some
    // sizes: a candidate like any other.
    c.push_back(Algorithm::Hierarchical);
  }
  return c;
}

// Buffers per size, reused by every candidate: f32 sums, as training's
// (zeros, but for the warm-up votes at the start of each rank's block:
// repeated sums neither overflow nor turn denormal).
struct Executor::ProbeBuffers {
  at::Tensor in, out;
  int64_t prepared = -1;  // the bytes they are sized for
};

double Executor::probe(Collective op, Algorithm algo, int64_t bytes, double vote,
                       ProbeBuffers& buffers) {
  const int p = engine_->size();
  const int64_t n = std::max<int64_t>(bytes / 4 / p, 1) * p;
  if (bytes != buffers.prepared) {
    buffers.prepared = bytes;
    if (op == Collective::AllReduce) {
      buffers.in = at::zeros({n}, at::kFloat);
    } else if (op == Collective::ReduceScatter) {
      buffers.in = at::zeros({n}, at::kFloat);
      buffers.out = at::empty({n / p}, at::kFloat);
    } else {
      buffers.in = at::zeros({n / p}, at::kFloat);
      buffers.out = at::empty({n}, at::kFloat);
    }
  }
  at::Tensor& in = buffers.in;
  at::Tensor& out = buffers.out;
  // The vote rides at the start of every rank's block; the sum of all
  // ranks' votes is read back at the same places.
  const int64_t block = n / p;
  float* src = in.data_ptr<float>();
  if (op == Collective::ReduceScatter) {
    for (int k = 0; k < p; ++k) src[k * block] = static_cast<float>(vote);
  } else {
    src[0] = static_cast<float>(vote);
  }
  const std::string step = "calibration of " + to_string(op) + " (" + to_string(algo) + ")";
  WorkPtr work;
  std::vector<at::Tensor> parts;  // outlives the wait
  if (algo == Algorithm::Engine) {
    if (op == Collective::AllReduce) {
      work = parent_.all_reduce(in, ReduceOp::Sum);
    } else if (op == Collective::ReduceScatter) {
      parts = chunks(in, p);
      work = parent_.reduce_scatter(out, parts, ReduceOp::Sum);
    } else {
      parts = chunks(out, p);
      work = parent_.all_gather(parts, in);
    }
  } else {
    // The job holds its own handles: a timed-out wait leaves it running.
    work = submit(step, options_.timeout, [this, op, algo, in, out](Link& link) mutable {
      if (op == Collective::AllReduce) {
        run_all_reduce(link, in, ReduceOp::Sum, algo);
      } else if (op == Collective::ReduceScatter) {
        run_reduce_scatter(link, out, in, ReduceOp::Sum, algo);
      } else {
        run_all_gather(link, out, in, algo);
      }
    });
  }
  try {
    work->wait(options_.timeout);
  } catch (const TimeoutError& e) {
    throw TimeoutError("cohort: " + step + " on rank " + std::to_string(engine_->rank()) + ": " +
                       e.what());
  }
  if (op == Collective::AllReduce) return static_cast<double>(src[0]);
  const float* dst = out.data_ptr<float>();
  if (op == Collective::ReduceScatter) return static_cast<double>(dst[0]);
  double sum = 0;
  for (int k = 0; k < p; ++k) sum += dst[k * block];
  return sum;
}

const Calibration& Executor::calibration(Collective op) {
  auto it = calibrations_.find(op);
  if (it != calibrations_.end()) return it->second;
  OpKindScope counted_as(OpKind::Calibration);
  // Runs on the caller's thread and times each candidate the way a loop
  // pays for it: the engine's collective on the Communicator's own engine,
  // called and waited for here (as the Communicator does for
  // Algorithm::Engine), every other algorithm handed to the worker and its
  // Work waited for. Timing the engine's collective on the private engine
  // instead, between the algorithms' transfers on the same connections,
  // measured it 17% faster than ring at 16 MiB where the loop found it 20%
  // slower (Gloo, world 2); timing everything on the worker left out the
  // hand-off only the algorithms pay. The private engine is free for this
  // thread once the jobs issued before have run: the caller is the only
  // one issuing, and it is here.
  submit("calibration of " + to_string(op) + " (earlier operations)", options_.timeout, [](Link&) {
  })->wait(options_.timeout);
  ProbeBuffers buffers;
  auto run = [&](Algorithm algo, int64_t bytes, double vote) {
    return probe(op, algo, bytes, vote, buffers);
  };
  return calibrations_[op] = calibrate(*engine_, *store_, op, candidates(op), run, options_.timeout,
                                       options_.calibration_max_bytes);
}

Algorithm Executor::resolve(Collective op, Algorithm requested, int64_t bytes) {
  Algorithm a = requested;
  if (a == Algorithm::Adaptive) a = calibration(op).model.best(static_cast<double>(bytes));
  if (op != Collective::AllReduce && (a == Algorithm::Tree || a == Algorithm::Hierarchical)) {
    a = Algorithm::Ring;
  }
  return a;
}

const Topology& Executor::topology() {
  if (!topology_) {
    topology_ = std::make_unique<Topology>(
        exchange_topology(*store_, engine_->rank(), engine_->size(), local_node_key(options_.node),
                          options_.timeout));
  }
  return *topology_;
}

Hierarchy& Executor::hierarchy() {
  if (!hierarchy_) {
    hierarchy_ = std::make_unique<Hierarchy>(*engine_, store_, topology(), options_.timeout);
  }
  return *hierarchy_;
}

void Executor::run_all_reduce(Link& link, at::Tensor& buf, ReduceOp op, Algorithm algo) {
  switch (algo) {
    case Algorithm::Ring:
      return ring_all_reduce(link, buf, op);
    case Algorithm::HalvingDoubling:
      return hd_all_reduce(link, buf, op);
    case Algorithm::Tree:
      return tree_all_reduce(link, buf, op);
    case Algorithm::Hierarchical:
      return hierarchy().all_reduce(link, buf, op);
    default:
      return link.wait(engine_->all_reduce(buf, op), "the engine's all_reduce");
  }
}

void Executor::run_reduce_scatter(Link& link, at::Tensor& out, const at::Tensor& in, ReduceOp op,
                                  Algorithm algo) {
  const int p = link.size();
  const auto blocks = equal_spans(out.numel(), p);
  const auto& mine = blocks[static_cast<size_t>(link.rank())];
  if (algo == Algorithm::Engine) {
    auto inputs = chunks(in, p);
    return link.wait(engine_->reduce_scatter(out, inputs, op), "the engine's reduce_scatter");
  }
  auto work = link.scratch(0, in.numel(), in);
  if (algo == Algorithm::HalvingDoubling) {
    work.copy_(in);
    hd_reduce_scatter(link, work, blocks, op);
  } else {
    ring_reduce_scatter(link, in, work, blocks, op);
  }
  out.copy_(work.narrow(0, mine.offset, mine.count));
}

void Executor::run_all_gather(Link& link, at::Tensor& out, const at::Tensor& in, Algorithm algo) {
  const int p = link.size();
  if (algo == Algorithm::Engine) {
    auto outputs = chunks(out, p);
    auto input = in;
    return link.wait(engine_->all_gather(outputs, input), "the engine's all_gather");
  }
  const auto blocks = equal_spans(in.numel(), p);
  out.narrow(0, blocks[static_cast<size_t>(link.rank())].offset, in.numel()).copy_(in);
  if (algo == Algorithm::HalvingDoubling) {
    hd_all_gather(link, out, blocks);
  } else {
    ring_all_gather(link, out, blocks);
  }
}

WorkPtr Executor::all_reduce(at::Tensor buf, ReduceOp op, Algorithm algo, Millis timeout) {
  return submit(to_string(algo) + " all_reduce", timeout,
                [this, buf, op, algo](Link& link) mutable { run_all_reduce(link, buf, op, algo); });
}

WorkPtr Executor::reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op, Algorithm algo,
                                 Millis timeout) {
  return submit(to_string(algo) + " reduce_scatter", timeout,
                [this, out, in, op, algo](Link& link) mutable {
                  run_reduce_scatter(link, out, in, op, algo);
                });
}

WorkPtr Executor::all_gather(at::Tensor out, at::Tensor in, Algorithm algo, Millis timeout) {
  return submit(to_string(algo) + " all_gather", timeout,
                [this, out, in, algo](Link& link) mutable { run_all_gather(link, out, in, algo); });
}

}  // namespace cohort::algorithms
