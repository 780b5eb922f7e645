// The cohort half of the ddp_vs_torch benchmark: one rank of a DDP training
// loop (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment, as
// torchrun and cohortrun set them). Rank 0 prints one JSON line:
//   {"engine": "cohort", "model": ..., "world": ..., "batch": ...,
//    "sps": samples per second over all ranks, "hidden_comm_share": ...,
//    "step_ms": rank 0's timed steps one by one, in milliseconds,
//    "bytes_sent_per_step": rank 0's bytes on the wire per timed step}
// With --leaves L (> 0), Determinism::WorldSizeInvariant: each rank runs its
// L / world leaves of batch * world / L samples, one forward and backward each.
// --device cuda puts the model and the data on the GPU (each step then ends
// with torch::cuda::synchronize(), so a step's time is the GPU's); --plain
// runs the same loop in plain LibTorch at world 1, without cohort ("engine":
// "libtorch"): the cost of cohort's DDP against none.
// (single steps let a caller take medians: a few steps stall on a busy host)
// run_ddp_vs_torch.py starts it next to ddp_vs_torch.py (PyTorch's DDP).
#include <torch/cuda.h>
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
  std::string device = "cpu";
  bool plain = false;
  cohort::DDPOptions ddp;  // --bucket-cap-mb, --first-bucket-mb, --bucket-view 0|1, --leaves
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
  app.add_option("--device", a.device, "where the model and the data live: cpu | cuda | cuda:N");
  app.add_flag("--plain", a.plain, "plain LibTorch at world 1: the same loop without cohort");
}

// Rank 0's timed steps, one by one, in milliseconds, and the seconds of all
// of them, after the untimed warm-up (`fence` ends each timed span: a
// barrier, so every rank's steps are in it).
struct Timing {
  std::vector<double> step_ms;
  double seconds = 0;
};

template <typename Step, typename Fence>
Timing time_steps(const Args& a, Step&& step, Fence&& fence) {
  const torch::Device device(a.device);
  // A CUDA step is queued, not done, when the host returns from it.
  auto done = [&] {
    if (device.is_cuda()) torch::cuda::synchronize();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  done();
  fence();
  Timing t;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < a.steps; ++i) {
    const auto s0 = std::chrono::steady_clock::now();
    step();
    done();
    t.step_ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - s0).count());
  }
  fence();
  t.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return t;
}

torch::Tensor loss_of(const Args& a, const torch::Tensor& out, const torch::Tensor& y) {
  return a.model == "transformer" ? torch::mse_loss(out, y) : torch::cross_entropy_loss(out, y);
}

void print_steps(const std::vector<double>& step_ms) {
  std::printf("\"step_ms\": [");
  for (size_t i = 0; i < step_ms.size(); ++i) std::printf("%s%.3f", i ? ", " : "", step_ms[i]);
  std::printf("]");
}

template <typename Holder>
void run_plain(const Args& a, Holder model) {
  const torch::Device device(a.device);
  model->to(device);
  torch::optim::SGD opt(model->parameters(), 0.01);
  auto [x, y] = cohort::bench::make_batch(a.model, a.batch);
  x = x.to(device);
  y = y.to(device);
  auto step = [&] {
    opt.zero_grad();
    loss_of(a, model->forward(x), y).backward();
    opt.step();
  };
  const auto t = time_steps(a, step, [] {});
  std::printf(
      "{\"engine\": \"libtorch\", \"model\": \"%s\", \"device\": \"%s\", \"world\": 1, "
      "\"batch\": %lld, \"sps\": %.3f, ",
      a.model.c_str(), a.device.c_str(), static_cast<long long>(a.batch),
      a.steps * a.batch / t.seconds);
  print_steps(t.step_ms);
  std::printf("}\n");
}

template <typename Holder>
void run(const Args& a, Holder model, std::shared_ptr<cohort::Communicator> comm) {
  const torch::Device device(a.device);
  auto options = a.ddp;
  int64_t leaf_batch = a.batch;
  if (options.leaves > 0) {
    options.determinism = cohort::Determinism::WorldSizeInvariant;
    if ((a.batch * comm->size()) % options.leaves != 0) {
      throw std::invalid_argument("--leaves must divide the global batch (batch x world)");
    }
    leaf_batch = a.batch * comm->size() / options.leaves;
  }
  model->to(device);
  cohort::DistributedDataParallel<Holder> ddp(model, comm, options);
  torch::optim::SGD opt(ddp.parameters(), 0.01);
  std::vector<std::pair<torch::Tensor, torch::Tensor>> leaves;
  for (int64_t l = 0; l < ddp.local_leaves(); ++l) {
    auto [x, y] = cohort::bench::make_batch(a.model, leaf_batch);
    leaves.emplace_back(x.to(device), y.to(device));
  }
  auto step = [&] {
    opt.zero_grad();
    for (const auto& [x, y] : leaves) loss_of(a, ddp.forward(x), y).backward();
    opt.step();
  };
  double comm0 = 0, hidden0 = 0;
  uint64_t sent0 = 0;
  int fences = 0;
  const auto t = time_steps(a, step, [&] {
    comm->barrier().wait();
    if (fences++ == 0) {  // the start of the timed steps
      comm0 = ddp.stats().total_comm_seconds;
      hidden0 = ddp.stats().total_hidden_comm_seconds;
      sent0 = comm->stats().total().bytes_sent;
    }
  });
  const double comm_s = ddp.stats().total_comm_seconds - comm0;
  const double sent = static_cast<double>(comm->stats().total().bytes_sent - sent0) / a.steps;
  const double hidden = comm_s > 0 ? (ddp.stats().total_hidden_comm_seconds - hidden0) / comm_s : 0;
  if (comm->rank() == 0) {
    std::printf(
        "{\"engine\": \"cohort\", \"model\": \"%s\", \"device\": \"%s\", \"world\": %d, "
        "\"batch\": %lld, \"sps\": %.3f, \"hidden_comm_share\": %.4f, \"comm_s_per_step\": %.6f, ",
        a.model.c_str(), a.device.c_str(), comm->size(), static_cast<long long>(a.batch),
        a.steps * a.batch * comm->size() / t.seconds, hidden, comm_s / a.steps);
    print_steps(t.step_ms);
    std::printf(", \"leaves\": %lld, \"bytes_sent_per_step\": %.0f}\n",
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
    auto with_model = [&](auto&& f) {
      if (a.model == "mlp")
        f(cohort::bench::make_mlp());
      else if (a.model == "cnn")
        f(cohort::bench::make_cnn());
      else if (a.model == "transformer")
        f(cohort::bench::TransformerStack());
      else
        throw std::invalid_argument("unknown model " + a.model);
    };
    if (a.plain) {
      torch::manual_seed(0);
      with_model([&](auto model) { run_plain(a, model); });
      return 0;
    }
    auto comm = cohort::init();
    torch::manual_seed(comm->rank());
    with_model([&](auto model) { run(a, model, comm); });
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "ddp_vs_torch: " << e.what() << "\n";
    return 1;
  }
}
