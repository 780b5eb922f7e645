// One rank of the zero_memory benchmark (RANK, WORLD_SIZE, MASTER_ADDR,
// MASTER_PORT from the environment): trains the 10M transformer of
// bench/ddp_vs_torch with AdamW in one mode and prints, on rank 0, one JSON
// line with the largest per-rank figures:
//   {"mode", "world", "state_bytes_per_rank", "grad_bytes_per_rank",
//    "grad_bytes_after_backward", "step_ms" (median step), "step_ms_min"}
// Modes (all on the same engine and communicator):
//   ddp    cohort DDP (gradients as bucket views: one copy) + torch AdamW
//   zero1  cohort DDP as above + ZeRO stage 1 (state sharded; DDP's
//          all-reduce, then an all-gather of the parameters)
//   zero2  ZeRO stage 2 alone (reduce-scatter into the shard, all-gather)
//   zero2_ddp  cohort DDP + ZeRO stage 2, which takes over DDP's reduction
//          (DDP's buckets freed; reduce-scatter instead of its all-reduce)
//   fused  FusedDistributedOptimizer (bucketed all-reduce + flat AdamW)
// grad_bytes_per_rank: gradient storage that persists between steps
// (distinct storages of DDP's buckets, the parameters' .grad and the
// optimizer's own gradient buffers), measured after the step.
// grad_bytes_after_backward: the same, measured between backward and step;
// for ZeRO-2 it includes the staging buffer that holds the .grad during
// backward and the step (the transient peak of this design).
// staging_bytes_per_rank: ZeRO-2's staging buffers (one per bucket), which
// outlive their use only as lazily freed pages (MADV_FREE,
// cohort/optim/staging_buffer.h).
// grad_peak_bytes: ZeRO-2: the shard plus the most staging alive at once
// during backward and the reduction (counted by the optimizer as buffers
// are taken and released); other modes: grad_bytes_after_backward.
// held_grad_peak_bytes: ZeRO-2: the most .grad bytes kept past their hook
// at once because they (partly) belong to a bucket that does not stage yet.
// bucket_bytes: ZeRO's largest bucket (0 for the other modes).
// --staged-buckets N: ZeroOptions::max_staged_buckets (1 or 2).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <iostream>
#include <set>
#include <string>

#include "bench/cli.h"
#include "bench/ddp_vs_torch/bench_models.h"
#include "cohort/cohort.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/optimizer_state.h"
#include "cohort/optim/zero_redundancy_optimizer.h"

namespace {

struct Args {
  std::string mode = "ddp";
  int64_t batch = 2;  // per rank (as ddp_vs_torch's transformer)
  int steps = 10;
  int warmup = 3;
  double bucket_mb = 25;                // ZeRO's and the fused optimizer's bucket cap
  std::string gather_algo = "default";  // ZeRO's parameter all-gather
  int staged_buckets = 1;               // ZeRO-2's max_staged_buckets
};

// Flags as run_zero_memory.py passes them; --help lists them with their
// defaults.
void add_flags(CLI::App& app, Args& a) {
  cohort::bench::show_defaults(app);
  app.add_option("--mode", a.mode, "ddp | zero1 | zero2 | zero2_ddp | fused")
      ->check(CLI::IsMember({"ddp", "zero1", "zero2", "zero2_ddp", "fused"}));
  cohort::bench::add_loop_flags(app, a.batch, a.steps, a.warmup);
  app.add_option("--bucket-mb", a.bucket_mb, "ZeRO's and the fused optimizer's bucket cap");
  app.add_option("--gather-algo", a.gather_algo, "ZeRO's parameter all-gather algorithm")
      ->check(
          CLI::IsMember({"default", "engine", "ring", "tree", "hd", "hierarchical", "adaptive"}));
  app.add_option("--staged-buckets", a.staged_buckets, "ZeroOptions::max_staged_buckets")
      ->check(CLI::IsMember({1, 2}));
}

// Bytes of the distinct storages among the given tensors.
int64_t distinct_bytes(const std::vector<torch::Tensor>& ts) {
  std::set<const void*> seen;
  int64_t bytes = 0;
  for (const auto& t : ts) {
    if (!t.defined()) continue;
    const auto& st = t.storage();
    if (seen.insert(st.data()).second) bytes += static_cast<int64_t>(st.nbytes());
  }
  return bytes;
}

int64_t max_over_ranks(cohort::Communicator& comm, int64_t v) {
  auto t = torch::tensor({v});
  comm.all_reduce(t, {cohort::ReduceOp::Max}).wait();
  return t.item<int64_t>();
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"zero_memory: one rank of the ZeRO and fused-optimizer memory benchmark"};
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    torch::manual_seed(0);  // same initial model everywhere
    cohort::bench::TransformerStack model;
    torch::manual_seed(1 + comm->rank());
    auto [x, y] = cohort::bench::make_batch("transformer", a.batch);
    const auto opts = torch::optim::AdamWOptions(1e-4);

    std::unique_ptr<cohort::DistributedDataParallel<cohort::bench::TransformerStack>> ddp;
    std::unique_ptr<torch::optim::AdamW> adamw;
    std::unique_ptr<cohort::ZeroRedundancyOptimizer> zero;
    std::unique_ptr<cohort::FusedDistributedOptimizer> fused;
    if (a.mode == "ddp" || a.mode == "zero1" || a.mode == "zero2_ddp") {
      cohort::DDPOptions o;
      o.gradient_as_bucket_view = true;
      ddp = std::make_unique<cohort::DistributedDataParallel<cohort::bench::TransformerStack>>(
          model, comm, o);
    } else {
      // Same starting point as DDP's broadcast.
      torch::NoGradGuard no_grad;
      for (auto p : model->parameters()) comm->broadcast(p).wait();
    }
    if (a.mode == "ddp") {
      adamw = std::make_unique<torch::optim::AdamW>(model->parameters(), opts);
    } else if (a.mode == "zero1" || a.mode == "zero2" || a.mode == "zero2_ddp") {
      cohort::ZeroOptions zo;
      zo.stage = a.mode == "zero1" ? 1 : 2;
      zo.bucket_cap_mb = a.bucket_mb;
      zo.max_staged_buckets = a.staged_buckets;
      if (a.gather_algo != "default") {
        const auto algo = cohort::parse_algorithm(a.gather_algo);
        if (!algo) throw std::invalid_argument("unknown --gather-algo " + a.gather_algo);
        zo.gather_algo = *algo;
      }
      if (ddp) {
        zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, opts, zo);
      } else {
        zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(model->parameters(), comm,
                                                                          opts, zo);
      }
    } else if (a.mode == "fused") {
      cohort::FusedOptions fo;
      fo.bucket_cap_mb = a.bucket_mb;
      fused =
          std::make_unique<cohort::FusedDistributedOptimizer>(model->parameters(), comm, opts, fo);
    } else {
      throw std::invalid_argument("unknown mode " + a.mode);
    }

    auto grad_storages = [&] {
      std::vector<torch::Tensor> ts;
      for (const auto& p : model->parameters()) ts.push_back(p.grad());
      if (ddp) {
        for (size_t i = 0; i < ddp->reducer().bucket_layout().size(); ++i) {
          ts.push_back(ddp->reducer().bucket_buffer(i));
        }
      }
      for (const auto& t : zero    ? zero->grad_buffers()
                           : fused ? fused->grad_buffers()
                                   : std::vector<torch::Tensor>{}) {
        ts.push_back(t);
      }
      return distinct_bytes(ts);
    };
    int64_t after_backward = 0;
    auto step = [&] {
      if (adamw) adamw->zero_grad();
      if (zero) zero->zero_grad();
      if (fused) fused->zero_grad();
      auto out = ddp ? ddp->forward(x) : model->forward(x);
      torch::mse_loss(out, y).backward();
      after_backward = grad_storages();
      if (adamw) adamw->step();
      if (zero) zero->step();
      if (fused) fused->step();
    };
    for (int i = 0; i < a.warmup; ++i) step();
    std::vector<double> ms;
    for (int i = 0; i < a.steps; ++i) {
      comm->barrier().wait();
      const auto t0 = std::chrono::steady_clock::now();
      step();
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    const int64_t state = adamw  ? cohort::optimizer_state_bytes(*adamw)
                          : zero ? zero->state_bytes()
                                 : fused->state_bytes();
    const int64_t grads = grad_storages();
    const int64_t state_max = max_over_ranks(*comm, state);
    const int64_t grads_max = max_over_ranks(*comm, grads);
    const int64_t after_max = max_over_ranks(*comm, after_backward);
    const int64_t staging_max = max_over_ranks(*comm, zero ? zero->staging_bytes() : 0);
    const bool zero2 = zero && zero->options().stage == 2 && comm->size() > 1;
    const int64_t elem = model->parameters().front().element_size();
    const int64_t peak_max = max_over_ranks(
        *comm, zero2 ? zero->partition().shard_numel() * elem + zero->staging_peak_bytes()
                     : after_backward);
    const int64_t held_max = max_over_ranks(*comm, zero2 ? zero->held_peak_bytes() : 0);
    int64_t bucket_bytes = 0;
    if (zero) {
      for (const auto& b : zero->partition().buckets())
        bucket_bytes = std::max(bucket_bytes, b.padded * elem);
    }
    int64_t params = 0;
    for (const auto& p : model->parameters()) params += p.numel();
    if (comm->rank() == 0) {
      std::printf(
          "{\"mode\": \"%s\", \"world\": %d, \"params\": %lld, \"state_bytes_per_rank\": %lld, "
          "\"grad_bytes_per_rank\": %lld, \"grad_bytes_after_backward\": %lld, "
          "\"staging_bytes_per_rank\": %lld, \"grad_peak_bytes\": %lld, \"held_grad_peak_bytes\": "
          "%lld, \"bucket_bytes\": %lld, "
          "\"step_ms\": %.3f, \"step_ms_min\": %.3f}\n",
          a.mode.c_str(), comm->size(), static_cast<long long>(params),
          static_cast<long long>(state_max), static_cast<long long>(grads_max),
          static_cast<long long>(after_max), static_cast<long long>(staging_max),
          static_cast<long long>(peak_max), static_cast<long long>(held_max),
          static_cast<long long>(bucket_bytes), ms[ms.size() / 2], ms.front());
    }
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "zero_memory: " << e.what() << "\n";
    return 1;
  }
}
