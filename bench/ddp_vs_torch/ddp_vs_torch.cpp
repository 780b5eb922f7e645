// The cohort half of the ddp_vs_torch benchmark: one rank of a DDP training
// loop (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment, as
// torchrun and cohortrun set them). Rank 0 prints one JSON line:
//   {"engine": "cohort", "model": ..., "world": ..., "batch": ...,
//    "sps": samples per second over all ranks, "hidden_comm_share": ...,
//    "step_ms": rank 0's timed steps one by one, in milliseconds,
//    "bytes_sent_per_step": rank 0's bytes on the wire per timed step}
// With --leaves L (> 0), Determinism::WorldSizeInvariant: each rank runs its
// L / world leaves of batch * world / L samples, one forward and backward each.
// (single steps let a caller take medians: a few steps stall on a busy host)
// run_ddp_vs_torch.py starts it next to ddp_vs_torch.py (PyTorch's DDP).
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "bench/cli.h"
#include "bench/ddp_vs_torch/bench_models.h"
#include "cohort/cohort.h"
#include "cohort/ddp/distributed_data_parallel.h"

namespace {

struct Args {
  std::string model = "mlp";  // mlp | cnn | transformer
  int64_t batch = 32;         // per rank
  int steps = 20;             // timed steps
  int warmup = 5;             // untimed steps first (bucket rebuild, caches)
  cohort::DDPOptions ddp;     // --bucket-cap-mb, --first-bucket-mb, --bucket-view 0|1, --leaves
};

// Flags as run_ddp_vs_torch.py, compare_binaries.py, run_trace_overhead.py
// and bench/ucx/training.sh pass them; --help lists them with their defaults.
void add_flags(CLI::App& app, Args& a) {
  cohort::bench::show_defaults(app);
  app.add_option("--model", a.model, "mlp | cnn | transformer")
      ->check(CLI::IsMember({"mlp", "cnn", "transformer"}));
  cohort::bench::add_loop_flags(app, a.batch, a.steps, a.warmup);
  app.add_option("--bucket-cap-mb", a.ddp.bucket_cap_mb, "DDPOptions::bucket_cap_mb");
  app.add_option("--first-bucket-mb", a.ddp.first_bucket_mb, "DDPOptions::first_bucket_mb");
  app.add_option("--bucket-view", a.ddp.gradient_as_bucket_view,
                 "DDPOptions::gradient_as_bucket_view (0 | 1)")
      ->check(CLI::IsMember({"0", "1"}));
  app.add_option("--leaves", a.ddp.leaves,
                 "leaves of the global batch for Determinism::WorldSizeInvariant (0: off)")
      ->check(CLI::NonNegativeNumber);
}

template <typename Holder>
void run(const Args& a, Holder model, std::shared_ptr<cohort::Communicator> comm) {
  auto options = a.ddp;
  int64_t leaf_batch = a.batch;
  if (options.leaves > 0) {
    options.determinism = cohort::Determinism::WorldSizeInvariant;
    if ((a.batch * comm->size()) % options.leaves != 0) {
      throw std::invalid_argument("--leaves must divide the global batch (batch x world)");
    }
    leaf_batch = a.batch * comm->size() / options.leaves;
  }
  cohort::DistributedDataParallel<Holder> ddp(model, comm, options);
  torch::optim::SGD opt(ddp.parameters(), 0.01);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> leaves;
  for (int64_t l = 0; l < ddp.local_leaves(); ++l) {
    leaves.push_back(cohort::bench::make_batch(a.model, leaf_batch));
  }
  auto step = [&] {
    opt.zero_grad();
    for (const auto& [x, y] : leaves) {
      auto out = ddp.forward(x);
      auto loss =
          a.model == "transformer" ? torch::mse_loss(out, y) : torch::cross_entropy_loss(out, y);
      loss.backward();
    }
    opt.step();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  comm->barrier().wait();
  const double comm0 = ddp.stats().total_comm_seconds;
  const double hidden0 = ddp.stats().total_hidden_comm_seconds;
  const auto sent0 = comm->stats().total().bytes_sent;
  std::vector<double> step_ms;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) {
    const auto s0 = std::chrono::steady_clock::now();
    step();
    step_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
  }
  comm->barrier().wait();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double comm_s = ddp.stats().total_comm_seconds - comm0;
  const double sent = static_cast<double>(comm->stats().total().bytes_sent - sent0) / a.steps;
  const double hidden = comm_s > 0 ? (ddp.stats().total_hidden_comm_seconds - hidden0) / comm_s : 0;
  if (comm->rank() == 0) {
    std::printf(
        "{\"engine\": \"cohort\", \"model\": \"%s\", \"world\": %d, \"batch\": %lld, "
        "\"sps\": %.3f, \"hidden_comm_share\": %.4f, \"comm_s_per_step\": %.6f, \"step_ms\": [",
        a.model.c_str(), comm->size(), static_cast<long long>(a.batch),
        a.steps * a.batch * comm->size() / secs, hidden, comm_s / a.steps);
    for (size_t i = 0; i < step_ms.size(); ++i) std::printf("%s%.3f", i ? ", " : "", step_ms[i]);
    std::printf("], \"leaves\": %lld, \"bytes_sent_per_step\": %.0f}\n",
                static_cast<long long>(options.leaves), sent);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"ddp_vs_torch: one rank of cohort DDP's side of the ddp_vs_torch benchmark"};
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    torch::manual_seed(comm->rank());
    if (a.model == "mlp") run(a, cohort::bench::make_mlp(), comm);
    else if (a.model == "cnn") run(a, cohort::bench::make_cnn(), comm);
    else if (a.model == "transformer") run(a, cohort::bench::TransformerStack(), comm);
    else throw std::invalid_argument("unknown model " + a.model);
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ddp_vs_torch: " << e.what() << "\n";
    return 1;
  }
}
