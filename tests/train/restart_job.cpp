// A small training job for the kill-and-restart test, run as processes by
// cohortrun. With --kill-at S, rank 1 SIGKILLs itself after step S on the
// first attempt (COHORT_RESTART_COUNT=0); cohortrun restarts the job, which
// resumes from the last checkpoint. Rank 0 prints "final loss: <%.17g>".
//
// Unlike the thread tests, each rank here has its own global generator, so
// the model uses dropout and the resume must restore every rank's RNG.
// With COHORT_TEST_DEVICE=cuda (scripts/gpu-check.sh) the model and its
// batches live on the GPU, whose dropout draws from the CUDA generator.
#include <signal.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "cohort/cohort.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"

int main(int argc, char** argv) {
  std::string dir;
  int64_t kill_at = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--kill-at") kill_at = std::stoll(argv[i + 1]);
  }
  if (dir.empty()) {
    std::fprintf(stderr, "usage: restart_job --dir DIR [--kill-at STEP]\n");
    return 2;
  }
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    const char* restart = std::getenv("COHORT_RESTART_COUNT");
    const bool first_attempt = restart == nullptr || std::string(restart) == "0";
    // Data and initial weights identical on every rank; dropout differs.
    torch::manual_seed(42);
    auto x = torch::randn({512, 16});
    auto y = x.matmul(torch::randn({16, 4})).argmax(1);
    torch::nn::Sequential net(torch::nn::Linear(16, 32), torch::nn::ReLU(),
                              torch::nn::Dropout(0.2), torch::nn::Linear(32, 4));
    const char* device_name = std::getenv("COHORT_TEST_DEVICE");
    const torch::Device device(device_name && *device_name ? device_name : "cpu");
    net->to(device);
    torch::manual_seed(1000 + comm->rank());  // every device's generator

    cohort::DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    cohort::TrainerOptions config;
    config.accumulation_steps = 2;
    config.max_grad_norm = 1.0;
    config.epochs = 3;  // 512 / 2 ranks / 8 / 2 = 16 steps an epoch
    config.checkpoint_dir = dir;
    config.checkpoint_every = 10;
    config.progress = false;
    cohort::Trainer trainer(
        cohort::TrainerWiring::ddp(ddp, opt),
        [&](const torch::data::Example<>& b) {
          return torch::nn::functional::cross_entropy(ddp.forward(b.data.to(device)),
                                                      b.target.to(device));
        },
        config);
    cohort::TensorDataSource source(x, y, 8, comm->rank(), comm->size());
    if (auto step = trainer.resume(); step && comm->rank() == 0) {
      std::printf("resumed from step %lld\n", static_cast<long long>(*step));
    }
    cohort::FitCallbacks callbacks;
    callbacks.on_step = [&](const cohort::StepMetrics& m) {
      if (first_attempt && comm->rank() == 1 && m.step == kill_at) ::raise(SIGKILL);
    };
    const auto steps = trainer.fit(source, callbacks);
    if (comm->rank() == 0 && !steps.empty()) {
      std::printf("final step %lld\nfinal loss: %.17g\n",
                  static_cast<long long>(steps.back().step), steps.back().loss);
    }
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "restart_job: %s\n", e.what());
    return 1;
  }
}
