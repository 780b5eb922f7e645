// traced_ddp: three DDP steps of a small MLP through the Trainer, for the
// trace process test: cohortrun -n 2 --trace DIR -- traced_ddp
#include <cstdio>

#include "cohort/cohort.h"
#include "train/train_fixtures.h"

int main() {
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    auto net = cohort::testing::make_mlp();
    cohort::DDPOptions options;
    options.first_bucket_mb = 0.0005;  // several buckets for a small model
    options.bucket_cap_mb = 0.0005;
    cohort::DistributedDataParallel<torch::nn::Sequential> ddp(net, comm, options);
    torch::optim::SGD sgd(ddp.parameters(), 0.1);
    cohort::TrainerOptions config;
    config.progress = false;
    cohort::LossFn loss = [&](const torch::data::Example<>& b) {
      return torch::nn::functional::cross_entropy(ddp.forward(b.data), b.target);
    };
    cohort::Trainer trainer(cohort::TrainerWiring::ddp(ddp, sgd), loss, config);
    const auto data = cohort::testing::make_data(64);
    for (int64_t s = 0; s < 3; ++s) {
      const int64_t start = (s * comm->size() + comm->rank()) * 4;
      trainer.train_step({{data.x.narrow(0, start, 4), data.y.narrow(0, start, 4)}});
    }
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "traced_ddp: %s\n", e.what());
    return 1;
  }
}
