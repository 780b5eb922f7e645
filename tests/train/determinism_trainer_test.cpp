// The Trainer with TrainerOptions::determinism WorldSizeInvariant: the CNN
// with BatchNorm of the DDP determinism tests, AdamW, clipping on, L = 4
// leaves, 6 steps through train_step (rank r's micro-batches its leaves):
// parameters and buffers the same bytes at worlds 1, 2 and 4 for the DDP,
// ZeRO-2 over DDP and FSDP wirings. Negative control: the same runs without
// the option (the Trainer's no_sync accumulation, loss / k) differ between
// worlds 1 and 4, and the test prints by how much. A wiring that cannot
// honour the option (the all-reduce wiring, a pipeline, the mesh), or one built
// without it, refuses it on every rank.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/thread_ranks.h"
#include "tests/ddp/determinism_support.h"
#include "train_fixtures.h"

namespace cohort::testing::determinism_test {
namespace {

enum class Wiring { Ddp, Zero2, Fsdp };

constexpr int64_t kLeaves = 4;
constexpr int kTrainSteps = 6;

const char* name_of(Wiring w) {
  return w == Wiring::Ddp ? "ddp" : w == Wiring::Zero2 ? "zero-2" : "fsdp";
}

// Every rank's parameters and buffers after kTrainSteps Trainer steps at
// `world` from `init`, with the option or without.
std::vector<std::vector<torch::Tensor>> train(Wiring w, int world, bool det, const Data& data,
                                              const Checkpoint& init) {
  std::vector<std::vector<torch::Tensor>> got(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    DetCnn model;
    load_model(*model, init);
    TrainerOptions config;
    config.max_grad_norm = 0.05;  // active: norms are ~0.1-1
    config.progress = false;
    config.accumulation_steps = kLeaves / world;
    if (det) {
      config.determinism = Determinism::WorldSizeInvariant;
      config.leaves = kLeaves;
    }
    const auto adamw = torch::optim::AdamWOptions(0.01).weight_decay(0.01);
    std::unique_ptr<DistributedDataParallel<DetCnn>> ddp;
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    std::unique_ptr<torch::optim::AdamW> opt;
    FullyShard root{nullptr};
    std::optional<TrainerWiring> wiring;
    if (w == Wiring::Fsdp) {
      FullyShardOptions o;
      o.determinism = config.determinism;
      o.leaves = config.leaves;
      root = wrap(model, comm, o);
      opt = std::make_unique<torch::optim::AdamW>(root->parameters(), adamw);
      wiring = TrainerWiring::fsdp(root, *opt);
    } else {
      DDPOptions o;
      o.determinism = config.determinism;
      o.leaves = config.leaves;
      ddp = std::make_unique<DistributedDataParallel<DetCnn>>(model, comm, o);
      if (w == Wiring::Ddp) {
        opt = std::make_unique<torch::optim::AdamW>(ddp->parameters(), adamw);
        wiring = TrainerWiring::ddp(*ddp, *opt);
      } else {
        ZeroOptions zo;
        zo.stage = 2;
        zo.determinism = config.determinism;
        zo.leaves = config.leaves;
        zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(*ddp, adamw, zo);
        wiring = TrainerWiring::ddp(*ddp, *zero);
      }
    }
    auto loss = [&](const torch::data::Example<>& b) {
      return torch::mse_loss(ddp ? ddp->forward(b.data) : root->forward(b.data), b.target);
    };
    Trainer trainer(std::move(*wiring), loss, config);
    const int64_t k = config.accumulation_steps, first = k * comm->rank();
    for (int s = 0; s < kTrainSteps; ++s) {
      std::vector<torch::data::Example<>> leaves;
      for (int64_t l = first; l < first + k; ++l) {
        leaves.push_back({data.xs[s][l].clone(), data.ys[s][l].clone()});
      }
      trainer.train_step(leaves);
    }
    if (!ddp) root->unshard();  // the module's own tensors hold the full values
    got[comm->rank()] = all_state(*model);
    if (!ddp) root->reshard();
  });
  return got;
}

void check(Wiring w) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  DetCnn proto;
  const Checkpoint init{all_state(*proto), "", {}};
  const auto n_params = static_cast<int64_t>(proto->parameters().size());
  auto params_of = [&](const std::vector<torch::Tensor>& s) {
    return std::vector<torch::Tensor>(s.begin(), s.begin() + n_params);
  };
  const auto data = make_data(true, kLeaves);
  const auto reference = train(w, 1, true, data, init)[0];
  ASSERT_GT(max_abs_diff(params_of(reference), params_of(init.state)), 1e-3)
      << "training moved nothing";
  for (int world : {2, 4}) {
    const auto got = train(w, world, true, data, init);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(same_bytes(got[r], reference))
          << name_of(w) << " world " << world << " rank " << r << ": largest difference "
          << max_abs_diff(got[r], reference);
    }
  }
  const auto plain1 = train(w, 1, false, data, init)[0];
  const auto plain4 = train(w, 4, false, data, init)[0];
  std::cout << "trainer " << name_of(w) << ": without the option, world 1 and world 4 differ by "
            << max_abs_diff(params_of(plain1), params_of(plain4))
            << " (largest parameter difference after " << kTrainSteps << " steps)\n";
  EXPECT_FALSE(same_bytes(params_of(plain1), params_of(plain4)));
}

TEST(TrainerDeterminism, DdpBitwiseAtWorlds124) { check(Wiring::Ddp); }

TEST(TrainerDeterminism, Zero2OverDdpBitwiseAtWorlds124) { check(Wiring::Zero2); }

TEST(TrainerDeterminism, FsdpBitwiseAtWorlds124) { check(Wiring::Fsdp); }

// Builds a Trainer on each of 2 ranks with `make` and returns each rank's
// InvalidArgument message (empty: none).
template <typename Make>
std::vector<std::string> refusals(Make&& make) {
  std::vector<std::string> errors(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    try {
      make(comm);
    } catch (const InvalidArgument& e) {
      errors[comm->rank()] = e.what();
    }
  });
  return errors;
}

TEST(TrainerDeterminism, RefusedWhereItCannotHold) {
  TrainerOptions config;
  config.progress = false;
  config.determinism = Determinism::WorldSizeInvariant;
  config.leaves = 4;
  config.accumulation_steps = 2;
  auto loss = [](const torch::data::Example<>& b) { return b.data.sum(); };
  auto expect = [](const std::vector<std::string>& errors, const std::string& what) {
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find(what), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("rank " + std::to_string(r)), std::string::npos) << errors[r];
    }
  };
  // A wiring that cannot sum in the canonical tree.
  expect(refusals([&](std::shared_ptr<Communicator> comm) {
           auto net = torch::nn::Linear(2, 1);
           testing::fill_alike(*net);
           torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1));
           Trainer trainer(TrainerWiring::all_reduce(net.ptr(), sgd, comm), loss, config);
         }),
         "the all-reduce wiring cannot honour it");
  // DDP built without the option; with it, but another accumulation.
  expect(refusals([&](std::shared_ptr<Communicator> comm) {
           DistributedDataParallel<torch::nn::Linear> ddp(torch::nn::Linear(2, 1), comm);
           torch::optim::SGD sgd(ddp.parameters(), torch::optim::SGDOptions(0.1));
           Trainer trainer(TrainerWiring::ddp(ddp, sgd), loss, config);
         }),
         "DDP was built without it");
  expect(refusals([&](std::shared_ptr<Communicator> comm) {
           DDPOptions o;
           o.determinism = Determinism::WorldSizeInvariant;
           o.leaves = 4;
           DistributedDataParallel<torch::nn::Linear> ddp(torch::nn::Linear(2, 1), comm, o);
           torch::optim::SGD sgd(ddp.parameters(), torch::optim::SGDOptions(0.1));
           auto wrong = config;
           wrong.accumulation_steps = 4;
           Trainer trainer(TrainerWiring::ddp(ddp, sgd), loss, wrong);
         }),
         "accumulation_steps must be this rank's leaves per step, 2");
  // A pipeline (here 2 stages, one per rank): its gradients are not summed
  // over leaves at all, so the option is refused by the wiring's name.
  expect(refusals([&](std::shared_ptr<Communicator> comm) {
           torch::nn::Sequential stage(torch::nn::Linear(2, 2));
           auto mse = [](const pipeline::Tensors& out, const pipeline::Tensors& t) {
             return torch::nn::functional::mse_loss(out[0], t[0]);
           };
           pipeline::PipelineRuntime rt(DeviceMesh::from_group(comm, "pp"),
                                        {pipeline::PipelineStage(comm->rank(), stage)},
                                        pipeline::Schedule1F1B(2, 2), mse);
           torch::optim::SGD sgd(rt.parameters(), torch::optim::SGDOptions(0.1));
           Trainer trainer(TrainerWiring::pipeline(rt, sgd), config);
         }),
         "a pipeline cannot honour it");
  // The TP x PP x DP mesh (here dp 2 alone): its synchronizer averages each
  // step's gradients in one all-reduce, not over leaves.
  expect(refusals([&](std::shared_ptr<Communicator> comm) {
           auto mesh = init_device_mesh(comm, {1, 2, 1}, {"pp", "dp", "tp"});
           torch::nn::Sequential stage(torch::nn::Linear(2, 2));
           GradientSynchronizer sync(mesh, stage.ptr(), {}, torch::Tensor());
           auto mse = [](const pipeline::Tensors& out, const pipeline::Tensors& t) {
             return torch::nn::functional::mse_loss(out[0], t[0]);
           };
           pipeline::PipelineRuntime rt(mesh["pp"], {pipeline::PipelineStage(0, stage)},
                                        pipeline::Schedule1F1B(1, 2), mse);
           torch::optim::SGD sgd(rt.parameters(), torch::optim::SGDOptions(0.1));
           Trainer trainer(TrainerWiring::mesh(mesh, rt, sgd, sync), config);
         }),
         "a TP x PP x DP mesh cannot honour it");
}

}  // namespace
}  // namespace cohort::testing::determinism_test
