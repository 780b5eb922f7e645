// Run: cohortrun -n 2 --max-restarts 1 -- build/examples/trainer/trainer_restart --dir /tmp/ckpt
// --fail-at 12
//
// The Trainer: micro-batches with gradient accumulation, clipping,
// checkpoints every few steps, and resume after a failure. With --fail-at S
// rank 1 crashes after step S on the first attempt; cohortrun restarts the
// job, and resume() continues from the last checkpoint (weights, optimizer
// state, data position and random generators), not from step 0.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "cohort/cohort.h"

int main(int argc, char** argv) {
  std::string dir = "/tmp/cohort-trainer-example";
  int64_t fail_at = -1;
  CLI::App app{"trainer_restart: the Trainer through a crash and a restart (cohortrun)"};
  app.option_defaults()->always_capture_default();
  app.add_option("--dir", dir, "checkpoint folder");
  app.add_option("--fail-at", fail_at,
                 "rank 1 crashes after this step on the first attempt (-1: never)");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto world = cohort::init();
    auto mesh = cohort::init_device_mesh(world, {world->size()}, {"dp"});
    const auto& comm = mesh.process_group();
    const char* restart = std::getenv("COHORT_RESTART_COUNT");  // set by cohortrun
    const bool first_attempt = restart == nullptr || std::string(restart) == "0";

    torch::manual_seed(0);
    auto x = torch::randn({256, 16});
    auto y = x.matmul(torch::randn({16, 3})).argmax(1);  // 3 classes
    torch::nn::Sequential net(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 3));
    cohort::DistributedDataParallel<torch::nn::Sequential> ddp(net, mesh);
    torch::optim::AdamW adamw(ddp->parameters(), torch::optim::AdamWOptions(1e-2));

    cohort::TrainerOptions config;
    config.accumulation_steps = 2;  // 2 micro-batches of 8 rows per rank and step
    config.max_grad_norm = 1.0;
    config.epochs = 2;  // 256 rows / 2 ranks / 16 = 8 steps an epoch
    config.checkpoint_dir = dir;
    config.checkpoint_every = 5;
    config.progress = false;
    // DDP + a LibTorch optimizer, as is (no_sync() between micro-batches).
    cohort::Trainer trainer(
        cohort::TrainerWiring::ddp(ddp, adamw),
        [&](const torch::data::Example<>& b) {
          return torch::nn::functional::cross_entropy(ddp->forward(b.data), b.target);
        },
        config);
    // Each rank reads its shard, reshuffled every epoch.
    cohort::TensorDataSource data(x, y, /*micro_batch=*/8, comm->rank(), comm->size());

    if (auto step = trainer.resume(); step && comm->rank() == 0) {
      std::printf("resumed from step %lld\n", static_cast<long long>(*step));
    }
    cohort::FitCallbacks callbacks;
    callbacks.on_step = [&](const cohort::StepMetrics& m) {
      if (first_attempt && comm->rank() == 1 && m.step == fail_at) std::raise(SIGKILL);  // a crash
    };
    const auto steps = trainer.fit(data, callbacks);
    if (comm->rank() == 0 && !steps.empty()) {
      std::printf("trainer_restart: finished at step %lld, loss %.4f\n",
                  static_cast<long long>(steps.back().step), steps.back().loss);
    }
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "trainer_restart: %s\n", e.what());
    return 1;
  }
}
