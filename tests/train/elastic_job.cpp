// A small training job for the elastic test, run as processes by cohortrun
// -n MIN:MAX. The global batch is 12 samples at any world size (micro-batch
// 12 / WORLD_SIZE). With --fail-rank R --fail-at S, rank R SIGKILLs itself
// after step S on every attempt that has a rank R: a slot that is lost for
// good, which only a smaller world gets past. Rank 0 saves the final
// parameters to --out.
#include <signal.h>
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "cohort/cohort.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/ddp_gradient_sync.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"

int main(int argc, char** argv) {
  std::string dir, out;
  int64_t fail_rank = -1, fail_at = -1, max_steps = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--out") out = argv[i + 1];
    if (flag == "--fail-rank") fail_rank = std::stoll(argv[i + 1]);
    if (flag == "--fail-at") fail_at = std::stoll(argv[i + 1]);
    if (flag == "--max-steps") max_steps = std::stoll(argv[i + 1]);
  }
  if (dir.empty()) {
    std::fprintf(stderr,
                 "usage: elastic_job --dir DIR [--out FILE] [--max-steps N] "
                 "[--fail-rank R --fail-at STEP]\n");
    return 2;
  }
  constexpr int64_t kGlobalBatch = 12;
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    if (kGlobalBatch % comm->size() != 0) {
      std::fprintf(stderr, "elastic_job: world %d does not divide the global batch %lld\n",
                   comm->size(), static_cast<long long>(kGlobalBatch));
      return 2;
    }
    torch::manual_seed(42);  // data and initial weights, the same on every rank
    auto x = torch::randn({240, 16});
    auto y = x.matmul(torch::randn({16, 4})).argmax(1);
    torch::nn::Sequential net(torch::nn::Linear(16, 32), torch::nn::Tanh(),
                              torch::nn::Linear(32, 4));
    cohort::DistributedDataParallel<torch::nn::Sequential> ddp(net, comm);
    torch::optim::AdamW opt(net->parameters(), torch::optim::AdamWOptions(1e-2));
    cohort::TrainerConfig config;
    config.max_grad_norm = 1.0;
    config.epochs = 2;  // 240 / 12 = 20 steps an epoch
    config.max_steps = max_steps;
    config.checkpoint_dir = dir;
    config.checkpoint_every = 5;
    config.progress = false;
    cohort::Trainer trainer(
        cohort::TrainerWiring::ddp(ddp, opt),
        [&](const torch::data::Example<>& b) {
          return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
        },
        config);
    cohort::TensorDataSource source(x, y, kGlobalBatch / comm->size(), comm->rank(), comm->size());
    if (auto step = trainer.resume(); step && comm->rank() == 0) {
      std::printf("resumed from step %lld at world %d\n", static_cast<long long>(*step),
                  comm->size());
    }
    cohort::FitCallbacks callbacks;
    callbacks.on_step = [&](const cohort::StepMetrics& m) {
      if (comm->rank() == fail_rank && m.step == fail_at) ::raise(SIGKILL);
    };
    const auto steps = trainer.fit(source, callbacks);
    if (comm->rank() == 0 && !steps.empty()) {
      std::printf("final step %lld\n", static_cast<long long>(steps.back().step));
      if (!out.empty()) {
        std::vector<torch::Tensor> params;
        for (const auto& p : net->parameters()) params.push_back(p.detach().clone());
        torch::save(params, out);
      }
    }
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "elastic_job: %s\n", e.what());
    return 1;
  }
}
