// A small training job for the kill-and-restart test, run as processes by
// cohortrun. With --kill-at S, rank 1 SIGKILLs itself after step S on the
// first attempt (COHORT_RESTART_COUNT=0); cohortrun restarts the job, which
// resumes from the last checkpoint. Rank 0 prints "final loss: <%.17g>".
//
// Unlike the thread tests, each rank here has its own global generator, so
// the model uses dropout and the resume must restore every rank's RNG.
// With COHORT_TEST_DEVICE=cuda (scripts/gpu-check.sh) the model and its
// batches live on the GPU, whose dropout draws from the CUDA generator.
//
// --noisy: the data source augments its inputs from the default generator
// and has no global order; --pipeline: the model is a pipeline of one stage
// per rank (1F1B) over the same samples, not DDP; --max-steps N stops
// there. Rank 0 prints every step's loss, every rank a digest of its
// parameters.
#include <signal.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "cohort/cohort.h"
#include "cohort/core/agreement.h"
#include "cohort/ddp/ddp_gradient_sync.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"

namespace {

// Noise on the inputs from the default generator (an augmentation), and no
// global sample order: global_micro_batch() 0.
class NoisySource : public cohort::DataSource {
 public:
  explicit NoisySource(cohort::TensorDataSource& inner) : inner_(inner) {}
  void set_epoch(int64_t epoch) override { inner_.set_epoch(epoch); }
  int64_t num_batches() const override { return inner_.num_batches(); }
  torch::data::Example<> batch(int64_t index) override {
    auto b = inner_.batch(index);
    return {b.data + 0.1 * torch::randn(b.data.sizes()), b.target};
  }
  torch::Tensor sample_indices(int64_t index) override { return inner_.sample_indices(index); }

 private:
  cohort::TensorDataSource& inner_;
};

void print_params(int rank, torch::nn::Module& model) {
  std::string bytes;
  for (const auto& p : model.parameters()) {
    const auto c = p.detach().cpu().contiguous();
    bytes.append(static_cast<const char*>(c.data_ptr()), c.numel() * c.element_size());
  }
  std::printf("params of rank %d: %llx\n", rank,
              static_cast<unsigned long long>(cohort::content_digest(bytes.data(), bytes.size())));
}

}  // namespace

int main(int argc, char** argv) {
  std::string dir;
  int64_t kill_at = -1, max_steps = 0;
  bool noisy = false, pipelined = false;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (flag == "--noisy") noisy = true;
    if (flag == "--pipeline") pipelined = true;
    if (i + 1 == argc) break;
    if (flag == "--dir") dir = argv[i + 1];
    if (flag == "--kill-at") kill_at = std::stoll(argv[i + 1]);
    if (flag == "--max-steps") max_steps = std::stoll(argv[i + 1]);
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

    cohort::TrainerOptions config;
    config.accumulation_steps = 2;
    config.max_grad_norm = 1.0;
    config.epochs = 3;  // 512 / 2 ranks / 8 / 2 = 16 steps an epoch
    config.max_steps = max_steps;
    config.checkpoint_dir = dir;
    config.checkpoint_every = 10;
    config.progress = false;
    std::optional<cohort::DistributedDataParallel<torch::nn::Sequential>> ddp;
    std::optional<cohort::pipeline::PipelineRuntime> runtime;
    std::optional<torch::optim::AdamW> opt;
    std::optional<cohort::Trainer> trainer;
    if (pipelined) {
      // One stage per rank, every rank the same samples.
      std::vector<int64_t> cuts;
      for (int r = 1; r < comm->size(); ++r) cuts.push_back(r);  // 4 layers, up to 4 stages
      std::vector<cohort::pipeline::PipelineStage> stages;
      stages.emplace_back(comm->rank(),
                          cohort::pipeline::split_sequential(net, cuts, comm->rank()));
      runtime.emplace(
          cohort::DeviceMesh::from_group(comm, "pp"), std::move(stages),
          cohort::pipeline::make_schedule("1f1b", comm->size(), 1, 2),
          [&](const cohort::pipeline::Tensors& out, const cohort::pipeline::Tensors& t) {
            return torch::nn::functional::cross_entropy(out[0], t[0].to(device));
          });
      opt.emplace(runtime->parameters(), torch::optim::AdamWOptions(1e-2));
      trainer.emplace(cohort::TrainerWiring::pipeline(*runtime, *opt), config);
    } else {
      ddp.emplace(net, comm);
      opt.emplace(net->parameters(), torch::optim::AdamWOptions(1e-2));
      trainer.emplace(
          cohort::TrainerWiring::ddp(*ddp, *opt),
          [&](const torch::data::Example<>& b) {
            return torch::nn::functional::cross_entropy(ddp->forward(b.data.to(device)),
                                                        b.target.to(device));
          },
          config);
    }
    cohort::TensorDataSource source(x, y, 8, pipelined ? 0 : comm->rank(),
                                    pipelined ? 1 : comm->size());
    NoisySource noisy_source(source);
    if (auto step = trainer->resume(); step && comm->rank() == 0) {
      std::printf("resumed from step %lld\n", static_cast<long long>(*step));
    }
    cohort::FitCallbacks callbacks;
    callbacks.on_step = [&](const cohort::StepMetrics& m) {
      if (comm->rank() == 0) std::printf("step %lld loss: %.17g\n", (long long)m.step, m.loss);
      if (first_attempt && comm->rank() == 1 && m.step == kill_at) ::raise(SIGKILL);
    };
    const auto steps =
        noisy ? trainer->fit(noisy_source, callbacks) : trainer->fit(source, callbacks);
    if (comm->rank() == 0 && !steps.empty()) {
      std::printf("final step %lld\nfinal loss: %.17g\n",
                  static_cast<long long>(steps.back().step), steps.back().loss);
    }
    print_params(comm->rank(), *net);
    std::fflush(stdout);
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "restart_job: %s\n", e.what());
    return 1;
  }
}
