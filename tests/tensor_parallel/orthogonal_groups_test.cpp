// DDP, fully_shard, ZeRO and the all-reduce sync over a model of
// tensor-parallel layers: over the
// mesh's "dp" group (ranks that share a TP rank) they train the TP shards of
// the one-process model; over a group whose ranks differ in TP rank (the
// whole world of a dp x tp mesh) they would average or broadcast different
// parts of one split tensor, a silent wrong model, so each refuses on every
// rank at construction, naming the parameter, the rank, a peer of another TP
// rank and the mesh's dp group. World 3 is a 1 x 3 mesh (every rank another
// TP rank), world 4 a 2 x 2 one. A clone() of the model (a deep copy, whose
// parameters are new tensors) trains and is refused alike, and training it
// leaves the original as drawn.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <stdexcept>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/plan/gradient_sync.h"
#include "cohort/tensor_parallel/layers.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"

namespace cohort::testing::orthogonal_groups_test {
namespace {

using Named = torch::OrderedDict<std::string, torch::Tensor>;

constexpr int64_t kIn = 6, kHidden = 12, kBatch = 12;  // 12 divides by every tp and dp here
constexpr int kSteps = 3;

enum class Mode { Ddp, Fsdp, Zero, AllReduce };
enum class Group { Dp, World };

struct Case {
  EngineWorld on;
  Mode mode;
  Group group;
  bool cloned = false;  // train model->clone() instead of the model
};

// dp x tp of each world size: 1 x 1, 1 x 2, 1 x 3, 2 x 2.
std::pair<int, int> mesh_shape(int world) {
  return world == 4 ? std::pair{2, 2} : std::pair{1, world};
}

// Column(6 -> 12), tanh, Row(12 -> 6): "0.weight" and "0.bias" split by
// rows, "2.weight" by columns, "2.bias" whole.
torch::nn::Sequential make_model(const std::shared_ptr<Communicator>& tp_group) {
  const auto tp = DeviceMesh::from_group(tp_group, "tp");
  tensor_parallel::ColumnParallelLinearOptions c;
  c.seed = 3;
  tensor_parallel::RowParallelLinearOptions r;
  r.seed = 4;
  return torch::nn::Sequential(tensor_parallel::ColumnParallelLinear(tp, kIn, kHidden, c),
                               torch::nn::Tanh(),
                               tensor_parallel::RowParallelLinear(tp, kHidden, kIn, r));
}

// The part of the one-process tensor `name` that TP rank `t` of `tp` holds.
torch::Tensor tp_slice(const std::string& name, const torch::Tensor& full, int t, int tp) {
  if (name.rfind("0.", 0) == 0) return full.chunk(tp, 0)[t];
  if (name == "2.weight") return full.chunk(tp, 1)[t];
  return full;
}

std::vector<torch::Tensor> batches(uint64_t seed, int64_t cols) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  std::vector<torch::Tensor> out;
  for (int s = 0; s < kSteps; ++s) out.push_back(torch::randn({kBatch, cols}, gen));
  return out;
}

const auto kX = batches(1, kIn), kY = batches(2, kIn);

Named reference() {
  Named out;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_model(comm);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(kX[s]), kY[s]).backward();
      opt.step();
    }
    for (const auto& p : model->named_parameters()) out.insert(p.key(), p.value().detach().clone());
  });
  return out;
}

// This DP rank's rows of the global batch.
torch::Tensor local(const torch::Tensor& global, const Communicator& dp) {
  const int64_t n = global.size(0) / dp.size();
  return global.narrow(0, dp.rank() * n, n);
}

// kSteps SGD steps of `mode` over `group`, each rank on its DP rank's rows;
// returns the (gathered) TP shards.
Named train(Mode mode, torch::nn::Sequential model, const std::shared_ptr<Communicator>& group,
            const Communicator& dp) {
  const auto sgd = torch::optim::SGDOptions(0.1);
  auto run = [&](auto&& forward, auto&& step, auto&& zero_grad) {
    for (int s = 0; s < kSteps; ++s) {
      zero_grad();
      torch::mse_loss(forward(local(kX[s], dp)), local(kY[s], dp)).backward();
      step();
    }
  };
  Named out;
  if (mode == Mode::Ddp) {
    DistributedDataParallel<torch::nn::Sequential> ddp(model, group);
    torch::optim::SGD opt(ddp.parameters(), sgd);
    run([&](const torch::Tensor& x) { return ddp.forward(x); }, [&] { opt.step(); },
        [&] { opt.zero_grad(); });
    out = model->named_parameters();
  } else if (mode == Mode::Fsdp) {
    auto sharded = fully_shard(model, group);
    torch::optim::SGD opt(sharded->parameters(), sgd);
    run([&](const torch::Tensor& x) { return sharded->forward(x); }, [&] { opt.step(); },
        [&] { opt.zero_grad(); });
    out = sharded->full_state_dict();
  } else if (mode == Mode::Zero) {
    auto zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(model->parameters(), group, sgd);
    run([&](const torch::Tensor& x) { return model->forward(x); }, [&] { zero->step(); },
        [&] { zero->zero_grad(); });
    out = model->named_parameters();
  } else {
    AllReduceGradientSync sync(group, model->parameters());
    torch::optim::SGD opt(model->parameters(), sgd);
    run([&](const torch::Tensor& x) { return model->forward(x); },
        [&] {
          sync.finish_sync();
          opt.step();
        },
        [&] { opt.zero_grad(); });
    out = model->named_parameters();
  }
  return out;
}

const char* who(Mode mode) {
  switch (mode) {
    case Mode::Ddp:
      return "DistributedDataParallel: on rank ";
    case Mode::Fsdp:
      return "fully_shard(torch::nn::SequentialImpl): on rank ";
    case Mode::Zero:
      return "ZeroRedundancyOptimizer: on rank ";
    case Mode::AllReduce:
      return "AllReduceGradientSync: on rank ";
  }
  return "";
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string case_text(const Case& c) {
  const char* modes[] = {"ddp", "fsdp", "zero", "all_reduce"};
  return c.on.backend + "_world" + std::to_string(c.on.world) + "_" +
         modes[static_cast<int>(c.mode)] + (c.group == Group::Dp ? "_over_dp" : "_over_world") +
         (c.cloned ? "_cloned" : "");
}

// A deep copy of `model` (torch::nn::Cloneable::clone).
torch::nn::Sequential clone_of(const torch::nn::Sequential& model) {
  return torch::nn::Sequential(
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

class OrthogonalGroups : public ::testing::TestWithParam<Case> {};

TEST_P(OrthogonalGroups, TrainOverTheDpGroupAndRefuseAGroupAcrossTp) {
  const auto c = GetParam();
  const int n = c.on.world;
  const auto [dp, tp] = mesh_shape(n);
  const auto expected = reference();
  std::vector<double> error(static_cast<size_t>(n), -1);
  auto o = options_for(c.on);
  o.timeout = std::chrono::seconds(10);
  const auto errors = errors_on_every_rank(
      n,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {dp, tp}, {"dp", "tp"});
        const auto dp_group = mesh["dp"].process_group();
        auto original = make_model(mesh["tp"].process_group());
        Named drawn;
        for (const auto& p : original->named_parameters()) drawn.insert(p.key(), p->clone());
        auto got = train(c.mode, c.cloned ? clone_of(original) : original,
                         c.group == Group::Dp ? dp_group : world, *dp_group);
        if (c.cloned) {
          for (const auto& p : original->named_parameters()) {
            if (!torch::equal(p.value(), drawn[p.key()])) {
              throw std::runtime_error("training the clone moved the original's " + p.key());
            }
          }
        }
        // The largest error of a shard, relative to its one-process slice.
        double worst = 0;
        for (const auto& e : expected) {
          const auto want = tp_slice(e.key(), e.value(), mesh.local_rank("tp"), tp);
          const auto* g = got.find(e.key());
          if (!g || g->sizes() != want.sizes()) throw std::runtime_error("no shard " + e.key());
          worst = std::max(
              worst, (*g - want).abs().max().item<double>() / want.abs().max().item<double>());
        }
        error[static_cast<size_t>(world->rank())] = worst;
      },
      o);
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    const double err = error[static_cast<size_t>(r)];
    if (c.group == Group::Dp || tp == 1) {
      EXPECT_EQ(e, kNoError) << "rank " << r;
      EXPECT_LE(err, 1e-5) << "rank " << r << ": shards differ from the one-process model";
      continue;
    }
    // The first rank of another TP rank than r's (TP rank = world rank % tp).
    int peer = 0;
    while (peer % tp == r % tp) ++peer;
    const std::string param =
        c.mode == Mode::Zero || c.mode == Mode::AllReduce ? "parameter 0 " : "parameter '0.weight'";
    EXPECT_TRUE(
        has(e, who(c.mode) + std::to_string(r) + " of " + std::to_string(n)) && has(e, param) &&
        has(e, "TP rank " + std::to_string(r % tp) + " of " + std::to_string(tp)) &&
        has(e, "rank " + std::to_string(peer) + " holds TP rank " + std::to_string(peer % tp)) &&
        has(e, "mesh[\"dp\"]"))
        << "rank " << r << ": " << e << " (max relative error of the shards after " << kSteps
        << " steps: " << err << ")";
  }
}

class SynchronizerOverOtherTpGroup : public ::testing::TestWithParam<EngineWorld> {};

// TP layers over the whole world (tp 4) under a synchronizer of a 1 x 2 x 2
// mesh: its "dp" pairs ranks 0 and 2, TP ranks 0 and 2 of the layers' group.
TEST_P(SynchronizerOverOtherTpGroup, IsRefusedOnEveryRank) {
  auto o = options_for(GetParam());
  o.timeout = std::chrono::seconds(10);
  const auto errors = errors_on_every_rank(
      4,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {1, 2, 2}, {"pp", "dp", "tp"});
        auto model = make_model(world);
        const auto drawn = model->named_parameters()["0.weight"].detach().clone();
        GradientSynchronizer sync(mesh, model.ptr(), {}, torch::Tensor());
        // Accepted: how far the DP broadcast moved this rank's part.
        const auto moved = (model->named_parameters()["0.weight"] - drawn).abs().max();
        throw std::runtime_error("accepted; '0.weight' moved by " +
                                 std::to_string(moved.item<float>()));
      },
      o);
  for (int r = 0; r < 4; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "DistributedDataParallel: on rank " + std::to_string(r / 2) + " of 2") &&
                has(e, "parameter '0.weight' holds TP rank " + std::to_string(r) + " of 4") &&
                has(e, "rank " + std::to_string(1 - r / 2) + " holds TP rank " +
                           std::to_string(r % 2 + 2 * (1 - r / 2))) &&
                has(e, "mesh[\"dp\"]"))
        << "rank " << r << ": " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, SynchronizerOverOtherTpGroup,
                         ::testing::ValuesIn(engine_worlds({4})), engine_world_name);

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& on : engine_worlds({1, 2, 3, 4})) {
    for (Mode mode : {Mode::Ddp, Mode::Fsdp, Mode::Zero, Mode::AllReduce}) {
      for (Group group : {Group::Dp, Group::World}) {
        for (bool cloned : {false, true}) out.push_back({on, mode, group, cloned});
      }
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(TensorParallel, OrthogonalGroups, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

}  // namespace
}  // namespace cohort::testing::orthogonal_groups_test
