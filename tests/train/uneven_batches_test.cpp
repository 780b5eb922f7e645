// Ranks whose batches differ in size: rank r passes 2 micro-batches of
// kSizes[r] samples (4, 2, 3), so its mean loss stands for fewer or more
// samples than its peers'. One Trainer step (MLP, MSE, SGD lr 0.1) must
// give every rank the parameters of one process's step on the concatenated
// batch (within 1e-6), the loss over all samples and their count, for each
// wiring that weights the ranks through their losses: DDP, ZeRO without
// DDP, FSDP, the all-reduce wiring, a pipeline (one stage x dp), the mesh
// wiring (pp 1 x dp x tp 1) and DDP with determinism WorldSizeInvariant (a
// leaf per micro-batch).
#include <gtest/gtest.h>
#include <torch/torch.h>

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
#include "support/engine_worlds.h"
#include "support/thread_ranks.h"
#include "train_fixtures.h"

namespace cohort::uneven_batches_test {
namespace {

using testing::make_mlp;

enum class Wiring { Ddp, Zero, Fsdp, AllReduce, Pipeline, Mesh, DdpPerLeaf };
const Wiring kWirings[] = {Wiring::Ddp,      Wiring::Zero, Wiring::Fsdp,      Wiring::AllReduce,
                           Wiring::Pipeline, Wiring::Mesh, Wiring::DdpPerLeaf};

const char* name_of(Wiring w) {
  switch (w) {
    case Wiring::Ddp:
      return "ddp";
    case Wiring::Zero:
      return "zero";
    case Wiring::Fsdp:
      return "fsdp";
    case Wiring::AllReduce:
      return "all-reduce";
    case Wiring::Pipeline:
      return "pipeline";
    case Wiring::Mesh:
      return "mesh";
    case Wiring::DdpPerLeaf:
      return "ddp world-size-invariant";
  }
  return "";
}

constexpr int64_t kSteps = 2;  // accumulation_steps
constexpr int64_t kSizes[] = {4, 2, 3};
constexpr double kLr = 0.1;

struct Data {
  torch::Tensor x, y;
  int64_t first(int rank) const {
    int64_t at = 0;
    for (int r = 0; r < rank; ++r) at += kSteps * kSizes[r];
    return at;
  }
};

Data make_data(int world) {
  auto gen = testing::make_generator(5);
  Data d;
  const int64_t n = d.first(world);
  d.x = torch::randn({n, 8}, gen);
  d.y = torch::randn({n, 4}, gen);
  return d;
}

// Rank `rank`'s micro-batches: kSteps of kSizes[rank] samples, in order.
std::vector<torch::data::Example<>> batches_of(const Data& d, int rank) {
  std::vector<torch::data::Example<>> out;
  for (int64_t i = 0; i < kSteps; ++i) {
    const int64_t at = d.first(rank) + i * kSizes[rank];
    out.push_back({d.x.narrow(0, at, kSizes[rank]), d.y.narrow(0, at, kSizes[rank])});
  }
  return out;
}

struct Reference {
  std::vector<torch::Tensor> params;
  double loss;
};

// One process, one SGD step on the mean loss of the whole batch.
Reference reference(const Data& d) {
  auto net = make_mlp();
  auto loss = torch::mse_loss(net->forward(d.x), d.y);
  loss.backward();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> params;
  for (auto& p : net->parameters()) params.push_back(p - kLr * p.grad());
  return {params, loss.item<double>()};
}

struct Got {
  std::vector<torch::Tensor> params;
  StepMetrics metrics;
};

// The model's full parameters after one Trainer step with rank `comm`'s batches.
Got train_one_step(Wiring w, std::shared_ptr<Communicator> comm, const Data& d) {
  auto net = make_mlp();
  TrainerOptions config;
  config.accumulation_steps = kSteps;
  config.progress = false;
  const torch::optim::SGDOptions sgd(kLr);
  std::unique_ptr<DistributedDataParallel<torch::nn::Sequential>> ddp;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<torch::optim::SGD> opt;
  std::unique_ptr<pipeline::PipelineRuntime> runtime;
  std::optional<DeviceMesh> mesh;
  std::unique_ptr<GradientSynchronizer> mesh_sync;
  FullyShard sharded{nullptr};
  std::optional<TrainerWiring> wiring;
  std::function<torch::Tensor(const torch::Tensor&)> forward = [&](const torch::Tensor& x) {
    return net->forward(x);
  };
  if (w == Wiring::Ddp || w == Wiring::DdpPerLeaf) {
    DDPOptions o;
    if (w == Wiring::DdpPerLeaf) {
      config.determinism = o.determinism = Determinism::WorldSizeInvariant;
      config.leaves = o.leaves = kSteps * comm->size();
    }
    ddp = std::make_unique<DistributedDataParallel<torch::nn::Sequential>>(net, comm, o);
    opt = std::make_unique<torch::optim::SGD>(net->parameters(), sgd);
    forward = [&](const torch::Tensor& x) { return ddp->forward(x); };
    wiring = TrainerWiring::ddp(*ddp, *opt);
  } else if (w == Wiring::Zero) {
    zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(net->parameters(), comm, sgd);
    wiring = TrainerWiring::zero(net.ptr(), *zero);
  } else if (w == Wiring::Fsdp) {
    torch::nn::Sequential units;
    for (size_t i : {0, 2}) {
      if (i == 2) units->push_back(torch::nn::Tanh());
      torch::nn::Linear linear(net->ptr<torch::nn::LinearImpl>(i));
      units->push_back(FullyShard(torch::nn::AnyModule(linear), comm));
    }
    sharded = fully_shard(units, comm);
    opt = std::make_unique<torch::optim::SGD>(sharded->parameters(), sgd);
    forward = [&](const torch::Tensor& x) { return sharded->forward(x); };
    wiring = TrainerWiring::fsdp(sharded, *opt);
  } else if (w == Wiring::AllReduce) {
    opt = std::make_unique<torch::optim::SGD>(net->parameters(), sgd);
    wiring = TrainerWiring::all_reduce(net.ptr(), *opt, comm);
  } else {
    mesh = w == Wiring::Pipeline ? init_device_mesh(comm, {comm->size(), 1}, {"dp", "pp"})
                                 : init_device_mesh(comm, {1, comm->size(), 1}, {"pp", "dp", "tp"});
    auto mse = [](const pipeline::Tensors& out, const pipeline::Tensors& target) {
      return torch::mse_loss(out[0], target[0]);
    };
    runtime = std::make_unique<pipeline::PipelineRuntime>(
        (*mesh)["pp"], std::vector<pipeline::PipelineStage>{pipeline::PipelineStage(0, net)},
        pipeline::Schedule1F1B(1, kSteps), mse);
    opt = std::make_unique<torch::optim::SGD>(runtime->parameters(), sgd);
    if (w == Wiring::Pipeline) {
      wiring = TrainerWiring::pipeline(*runtime, *opt, *mesh);
    } else {
      mesh_sync = std::make_unique<GradientSynchronizer>(
          *mesh, net.ptr(), std::vector<torch::Tensor>{}, torch::Tensor());
      wiring = TrainerWiring::mesh(*mesh, *runtime, *opt, *mesh_sync);
    }
  }
  LossFn loss;
  if (w != Wiring::Pipeline && w != Wiring::Mesh) {
    loss = [&](const torch::data::Example<>& b) {
      return torch::mse_loss(forward(b.data), b.target);
    };
  }
  Trainer trainer(std::move(*wiring), loss, config);
  Got got;
  got.metrics = trainer.train_step(batches_of(d, comm->rank()));
  if (sharded) sharded->unshard();  // the layers' own tensors hold the full values
  for (const auto& p : net->parameters()) got.params.push_back(p.detach().clone());
  if (sharded) sharded->reshard();
  return got;
}

class UnevenBatches : public ::testing::TestWithParam<testing::EngineWorld> {};

TEST_P(UnevenBatches, TrainAsOneProcessOnTheConcatenatedBatch) {
  const auto& c = GetParam();
  const Data d = make_data(c.world);
  const Reference ref = reference(d);
  const int64_t samples = d.first(c.world);
  for (Wiring w : kWirings) {
    testing::run_ranks_shared(
        c.world,
        [&](std::shared_ptr<Communicator> comm) {
          const Got got = train_one_step(w, comm, d);
          const std::string who = std::string(name_of(w)) + " rank " + std::to_string(comm->rank());
          ASSERT_EQ(got.params.size(), ref.params.size()) << who;
          for (size_t i = 0; i < ref.params.size(); ++i) {
            const double diff = (got.params[i] - ref.params[i]).abs().max().item<double>();
            EXPECT_LT(diff, 1e-6) << who << ": parameter " << i << " off by " << diff;
          }
          EXPECT_EQ(got.metrics.samples, samples) << who;
          // Float32 losses summed in other orders: a few ulps of 1.
          EXPECT_NEAR(got.metrics.loss, ref.loss, 1e-6) << who;
        },
        testing::options_for(c));
  }
}

INSTANTIATE_TEST_SUITE_P(EngineWorlds, UnevenBatches,
                         ::testing::ValuesIn(testing::engine_worlds({1, 2, 3})),
                         testing::engine_world_name);

}  // namespace
}  // namespace cohort::uneven_batches_test
