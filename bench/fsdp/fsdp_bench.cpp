// One rank of the fsdp benchmark (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT from the environment): trains the transformer of
// bench/ddp_vs_torch (12 encoder layers, d_model 256, 4 heads, feed-forward
// 1024, a 256x256 head; built as a Sequential of the same layers so that
// each layer can be a unit) with AdamW in one mode and prints, on rank 0,
// one JSON line with the largest per-rank figures. Modes:
//   ddp        cohort DDP (gradients as bucket views) + torch AdamW
//   zero2      ZeRO stage 2 alone (reduce-scatter into the shard, all-gather)
//   fsdp       fully_shard: each layer a unit, the head held by the root
//   fsdp_bf16  the same with MixedPrecisionPolicy{bfloat16, float32}
// Figures (bytes per rank; one cohort::memory::MemoryScope spans the whole
// rank, so it counts every tensor storage its thread holds):
//   held_bytes      parameters + gradients + optimizer state after a step
//                   (distinct storages of the parameters, their .grad, DDP's
//                   buckets, ZeRO's gradient buffers, and the state)
//   peak_bytes      the most storage held at once during one step
//   act_peak_bytes  what the bare model's forward and backward on this
//                   rank's batch, in the mode's compute dtype, with .grad
//                   already allocated, add at their peak: the activations
//                   and autograd's temporaries, which every mode has
//   peak_pgs_bytes  peak - activations: parameters, gradients, state and
//                   the buffers that carry them, at the step's peak
//   wire_bytes      bytes sent per step (Communicator::stats())
//   ag_flight_ms, ag_wait_ms  per step, all-gather time in flight and time
//                   the caller was blocked waiting for one: the rest of the
//                   flight was hidden behind compute
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <set>
#include <string>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/memory/memory_scope.h"
#include "cohort/optim/optimizer_state.h"
#include "cohort/optim/zero_redundancy_optimizer.h"

namespace {

struct Args {
  std::string mode = "fsdp";
  int64_t batch = 2;  // per rank (as ddp_vs_torch's transformer)
  int steps = 10;
  int warmup = 3;
  bool reshard_after_forward = true;
};

// Flags as run_fsdp_bench.py passes them; --help lists them with their
// defaults.
void add_flags(CLI::App& app, Args& a) {
  cohort::bench::show_defaults(app);
  app.add_option("--mode", a.mode, "ddp | zero2 | fsdp | fsdp_bf16")
      ->check(CLI::IsMember({"ddp", "zero2", "fsdp", "fsdp_bf16"}));
  cohort::bench::add_loop_flags(app, a.batch, a.steps, a.warmup);
  app.add_option("--reshard-after-forward", a.reshard_after_forward,
                 "FullyShardOptions::reshard_after_forward (0 | 1)")
      ->check(CLI::IsMember({"0", "1"}));
}

// bench_models.h's TransformerStack, layer by layer.
torch::nn::Sequential transformer() {
  torch::nn::Sequential seq;
  for (int i = 0; i < 12; ++i) {
    seq->push_back(torch::nn::TransformerEncoderLayer(
        torch::nn::TransformerEncoderLayerOptions(256, 4).dim_feedforward(1024).dropout(0.0)));
  }
  seq->push_back(torch::nn::Linear(256, 256));
  return seq;
}

int64_t distinct_bytes(const std::vector<torch::Tensor>& ts) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : ts) {
    if (t.defined() && seen.insert(t.storage().data()).second) bytes += t.storage().nbytes();
  }
  return bytes;
}

int64_t max_over_ranks(cohort::Communicator& comm, int64_t v) {
  auto t = torch::tensor({v});
  comm.all_reduce(t, {cohort::ReduceOp::Max}).wait();
  return t.item<int64_t>();
}

double max_over_ranks(cohort::Communicator& comm, double v) {
  auto t = torch::tensor({v}, torch::kDouble);
  comm.all_reduce(t, {cohort::ReduceOp::Max}).wait();
  return t.item<double>();
}

// The bare model's forward and backward on x (grads allocated first).
int64_t activation_peak(torch::Dtype dtype, const torch::Tensor& x, const torch::Tensor& y) {
  auto bare = transformer();
  bare->to(dtype);
  auto loss = [&] { return torch::mse_loss(bare->forward(x.to(dtype)).to(torch::kFloat), y); };
  loss().backward();
  cohort::memory::MemoryScope scope;
  loss().backward();
  return scope.peak_bytes();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"fsdp_bench: one rank of the fully_shard memory and step-time benchmark"};
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    cohort::memory::MemoryScope rank_scope;
    torch::set_num_threads(1);
    auto comm = cohort::init();
    torch::manual_seed(0);  // same initial model everywhere
    auto model = transformer();
    int64_t numel = 0;  // before sharding
    for (const auto& p : model->parameters()) numel += p.numel();
    torch::manual_seed(1 + comm->rank());
    auto x = torch::randn({16, a.batch, 256}), y = torch::randn({16, a.batch, 256});
    const auto opts = torch::optim::AdamWOptions(1e-4);
    const bool bf16 = a.mode == "fsdp_bf16";

    std::unique_ptr<cohort::DistributedDataParallel<torch::nn::Sequential>> ddp;
    cohort::FullyShard fsdp{nullptr};
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::unique_ptr<cohort::ZeroRedundancyOptimizer> zero;
    if (a.mode == "ddp") {
      cohort::DDPOptions o;
      o.gradient_as_bucket_view = true;
      ddp =
          std::make_unique<cohort::DistributedDataParallel<torch::nn::Sequential>>(model, comm, o);
      adamw = std::make_unique<torch::optim::AdamW>(model->parameters(), opts);
    } else if (a.mode == "zero2") {
      torch::NoGradGuard no_grad;
      for (auto p : model->parameters()) comm->broadcast(p).wait();
      cohort::ZeroOptions zo;
      zo.stage = 2;
      zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(model->parameters(), comm,
                                                                        opts, zo);
    } else if (a.mode == "fsdp" || bf16) {
      cohort::FullyShardOptions fo;
      fo.reshard_after_forward = a.reshard_after_forward;
      if (bf16) {
        fo.mp_policy.param_dtype = torch::kBFloat16;
        fo.mp_policy.reduce_dtype = torch::kFloat;
      }
      auto root = fo;
      root.mp_policy.output_dtype = torch::kFloat;
      fsdp = cohort::fully_shard(cohort::shard_blocks(model, comm, fo), comm, root);
      adamw = std::make_unique<torch::optim::AdamW>(fsdp->parameters(), opts);
    } else {
      throw std::invalid_argument("unknown mode " + a.mode);
    }
    auto params = [&] { return fsdp ? fsdp->parameters() : model->parameters(); };

    auto held = [&] {
      std::vector<torch::Tensor> ps, gs;
      for (const auto& p : params()) {
        ps.push_back(p);
        gs.push_back(p.grad());
      }
      if (ddp) {
        for (size_t i = 0; i < ddp->reducer().bucket_layout().size(); ++i) {
          gs.push_back(ddp->reducer().bucket_buffer(i));
        }
      }
      if (zero) {
        for (const auto& t : zero->grad_buffers()) gs.push_back(t);
      }
      const int64_t state = adamw ? cohort::optimizer_state_bytes(*adamw) : zero->state_bytes();
      return distinct_bytes(ps) + distinct_bytes(gs) + state;
    };
    auto step = [&] {
      if (adamw) adamw->zero_grad();
      if (zero) zero->zero_grad();
      auto out = ddp ? ddp->forward(x) : fsdp ? fsdp->forward(x) : model->forward(x);
      torch::mse_loss(out, y).backward();
      if (adamw) adamw->step();
      if (zero) zero->step();
    };
    for (int i = 0; i < a.warmup; ++i) step();
    const int64_t held_bytes = held();
    rank_scope.reset_peak();
    step();
    const int64_t peak = rank_scope.peak_bytes();
    comm->barrier().wait();
    comm->reset_stats();
    std::vector<double> ms;
    for (int i = 0; i < a.steps; ++i) {
      comm->barrier().wait();
      const auto t0 = std::chrono::steady_clock::now();
      step();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    const auto stats = comm->stats();
    const auto ag = stats[cohort::OpKind::AllGatherIntoTensor];
    // One barrier per step is in the totals: it moves no bytes.
    const double wire = static_cast<double>(stats.total().bytes_sent) / a.steps;
    std::sort(ms.begin(), ms.end());
    const int64_t act = activation_peak(bf16 ? torch::kBFloat16 : torch::kFloat, x, y);
    const int64_t held_max = max_over_ranks(*comm, held_bytes);
    const int64_t peak_max = max_over_ranks(*comm, peak);
    const int64_t act_max = max_over_ranks(*comm, act);
    const int64_t pgs_max = max_over_ranks(*comm, peak - act);
    const double wire_max = max_over_ranks(*comm, wire);
    const double flight = max_over_ranks(*comm, ag.seconds_in_flight * 1e3 / a.steps);
    const double waiting = max_over_ranks(*comm, ag.seconds_waiting * 1e3 / a.steps);
    if (comm->rank() == 0) {
      std::printf(
          "{\"mode\": \"%s\", \"world\": %d, \"params\": %lld, \"held_bytes\": %lld, "
          "\"peak_bytes\": %lld, \"act_peak_bytes\": %lld, \"peak_pgs_bytes\": %lld, "
          "\"wire_bytes\": %.0f, \"ag_flight_ms\": %.3f, \"ag_wait_ms\": %.3f, "
          "\"step_ms\": %.3f, \"step_ms_min\": %.3f}\n",
          a.mode.c_str(), comm->size(), static_cast<long long>(numel),
          static_cast<long long>(held_max), static_cast<long long>(peak_max),
          static_cast<long long>(act_max), static_cast<long long>(pgs_max), wire_max, flight,
          waiting, ms[ms.size() / 2], ms.front());
    }
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "fsdp_bench: " << e.what() << "\n";
    return 1;
  }
}
