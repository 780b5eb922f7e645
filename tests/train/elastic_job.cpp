// A small training job for the elastic test, run as processes by cohortrun
// -n MIN:MAX. The global batch is 12 samples at any world size (micro-batch
// 12 / WORLD_SIZE). With --fail-rank R --fail-at S, rank R SIGKILLs itself
// after step S on every attempt that has a rank R: a slot that is lost for
// good, which only a smaller world gets past. Rank 0 saves the final
// parameters to --out.
//
// With --hold STEP@WORLD[,STEP@WORLD...], rank 0 of a world of WORLD ranks
// stops after step STEP, creates DIR/held-STEP-world-WORLD and waits there
// (at most 120 s, then fails) for the launcher to end the attempt: a test
// can then kill or stop a node at a known step, so the steps each world
// size runs are known and a reference can follow them.
#include <signal.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

#include "cohort/cohort.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"

namespace {

// "12@3,17@2" -> {(12, 3), (17, 2)}.
std::set<std::pair<int64_t, int>> parse_holds(const std::string& text) {
  std::set<std::pair<int64_t, int>> holds;
  std::istringstream in(text);
  for (std::string item; std::getline(in, item, ',');) {
    const auto at = item.find('@');
    if (at == std::string::npos) throw std::invalid_argument("--hold wants STEP@WORLD: " + item);
    holds.emplace(std::stoll(item.substr(0, at)), std::stoi(item.substr(at + 1)));
  }
  return holds;
}

// Tells the test where the job is, then waits to be stopped by the launcher.
[[noreturn]] void hold(const std::string& dir, int64_t step, int world) {
  const std::string marker =
      dir + "/held-" + std::to_string(step) + "-world-" + std::to_string(world);
  std::ofstream(marker) << "held\n";
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  throw std::runtime_error("held at step " + std::to_string(step) +
                           " for 120 s and nobody ended the attempt");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir, out, holds_text;
  int64_t fail_rank = -1, fail_at = -1, max_steps = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--out") out = argv[i + 1];
    if (flag == "--fail-rank") fail_rank = std::stoll(argv[i + 1]);
    if (flag == "--fail-at") fail_at = std::stoll(argv[i + 1]);
    if (flag == "--max-steps") max_steps = std::stoll(argv[i + 1]);
    if (flag == "--hold") holds_text = argv[i + 1];
  }
  if (dir.empty()) {
    std::fprintf(stderr,
                 "usage: elastic_job --dir DIR [--out FILE] [--max-steps N] "
                 "[--fail-rank R --fail-at STEP] [--hold STEP@WORLD,...]\n");
    return 2;
  }
  constexpr int64_t kGlobalBatch = 12;
  try {
    const auto holds = parse_holds(holds_text);
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
    cohort::TrainerOptions config;
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
      // A generation may end with this rank killed: the line must not die in
      // stdout's buffer (the pipe to the launcher is not a terminal).
      std::fflush(stdout);
    }
    cohort::FitCallbacks callbacks;
    callbacks.on_step = [&](const cohort::StepMetrics& m) {
      if (comm->rank() == fail_rank && m.step == fail_at) ::raise(SIGKILL);
      if (comm->rank() == 0 && holds.count({m.step, comm->size()}) != 0) {
        hold(dir, m.step, comm->size());
      }
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
