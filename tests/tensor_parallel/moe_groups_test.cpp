// An MoE whose experts are split over ranks (over its ep group, or each
// expert's FFN over its tp group) under the modes that take every parameter
// for replicated over their group: DDP, ZeRO, the fused optimizer, the
// all-reduce wiring, FSDP and a pipeline's data parallelism each refuse it
// on every rank, naming the parameter, before any broadcast replaces a
// rank's experts; at world 1 (nothing split) each accepts it and leaves the
// experts as drawn. On the mesh, TrainerWiring::mesh refuses MoE layers
// split over other groups than the mesh's "ep" and "tp" or counting their
// load-balancing loss over another group than its "cp", and an expert list
// that is not exactly the MoE layers' experts.
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <stdexcept>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"

namespace cohort::testing::moe_groups_test {
namespace {

using namespace cohort::expert_parallel;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

enum class Split { Ep, Tp };
enum class Mode { Ddp, Zero, Fused, AllReduce, Fsdp, Pipeline };

// E and F divide by 1, 2 and 3.
MoEOptions options(Split split, std::shared_ptr<Communicator> group) {
  MoEOptions o;
  o.hidden = 4;
  o.ffn = 6;
  o.experts = 6;
  o.seed = 5;
  (split == Split::Ep ? o.ep_group : o.tp_group) = std::move(group);
  return o;
}

torch::Tensor mse(const pipeline::Tensors& out, const pipeline::Tensors& target) {
  return torch::nn::functional::mse_loss(out[0], target[0]);
}

// Builds `mode`'s parts over `net` and its TrainerWiring.
void wire(Mode mode, torch::nn::Sequential net, std::shared_ptr<Communicator> world) {
  const auto sgd = torch::optim::SGDOptions(0.1);
  switch (mode) {
    case Mode::Ddp: {
      DistributedDataParallel<torch::nn::Sequential> ddp(net, world);
      torch::optim::SGD opt(ddp.parameters(), sgd);
      TrainerWiring::ddp(ddp, opt);
      break;
    }
    case Mode::Zero: {
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(net->parameters(), world, sgd);
      TrainerWiring::zero(net.ptr(), *zero);
      break;
    }
    case Mode::Fused: {
      FusedDistributedOptimizer fused(net->parameters(), world, torch::optim::AdamWOptions(1e-2));
      TrainerWiring::fused(net.ptr(), fused);
      break;
    }
    case Mode::AllReduce: {
      torch::optim::SGD opt(net->parameters(), sgd);
      TrainerWiring::all_reduce(net.ptr(), opt, world);
      break;
    }
    case Mode::Fsdp: {
      auto sharded = fully_shard(net, world);
      torch::optim::SGD opt(sharded->parameters(), sgd);
      TrainerWiring::fsdp(sharded, opt);
      break;
    }
    case Mode::Pipeline: {
      auto mesh = init_device_mesh(world, {1, world->size()}, {"pp", "dp"});
      pipeline::PipelineRuntime rt(mesh["pp"], {pipeline::PipelineStage(0, net)},
                                   pipeline::Schedule1F1B(1, 2), mse);
      torch::optim::SGD opt(rt.parameters(), sgd);
      TrainerWiring::pipeline(rt, opt, mesh);
      break;
    }
  }
}

// The error each mode's refusal names itself by.
std::string who(Mode mode) {
  switch (mode) {
    case Mode::Ddp:
      return "DistributedDataParallel: on rank ";
    case Mode::Zero:
      return "ZeroRedundancyOptimizer: on rank ";
    case Mode::Fused:
      return "FusedDistributedOptimizer: on rank ";
    case Mode::AllReduce:
    case Mode::Pipeline:
      return "AllReduceGradientSync: on rank ";
    case Mode::Fsdp:
      return "fully_shard(";
  }
  return "";
}

struct Case {
  EngineWorld on;
  Split split;
  Mode mode;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& on : engine_worlds({1, 2, 3})) {
    for (Split split : {Split::Ep, Split::Tp}) {
      for (Mode mode :
           {Mode::Ddp, Mode::Zero, Mode::Fused, Mode::AllReduce, Mode::Fsdp, Mode::Pipeline}) {
        out.push_back({on, split, mode});
      }
    }
  }
  return out;
}

std::string case_text(const Case& c) {
  const char* modes[] = {"ddp", "zero", "fused", "all_reduce", "fsdp", "pipeline"};
  return c.on.backend + "_world" + std::to_string(c.on.world) +
         (c.split == Split::Ep ? "_ep_" : "_tp_") + modes[static_cast<int>(c.mode)];
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) { return case_text(info.param); }

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

class SplitExpertsOutsideTheMesh : public ::testing::TestWithParam<Case> {};

TEST_P(SplitExpertsOutsideTheMesh, AreRefusedOnEveryRank) {
  const auto c = GetParam();
  const int n = c.on.world;
  auto o = options_for(c.on);
  o.timeout = std::chrono::seconds(5);
  auto errors = errors_on_every_rank(
      n,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        MoE moe(options(c.split, world));
        const auto drawn = moe->w1.detach().clone();
        wire(c.mode, torch::nn::Sequential(moe), world);
        // Accepted: what the mode did to this rank's experts (a broadcast
        // from rank 0 replaces them).
        const auto w1 = moe->w1.detach();
        throw std::runtime_error("accepted; w1 moved by " +
                                 (w1.sizes() == drawn.sizes()
                                      ? std::to_string((w1 - drawn).abs().max().item<float>())
                                      : std::string("a shard")));
      },
      o);
  for (int r = 0; r < n; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    if (n == 1) {
      EXPECT_TRUE(has(e, "accepted; w1 moved by 0.0")) << e;
      continue;
    }
    EXPECT_TRUE(has(e, who(c.mode)) && has(e, "holds only this rank's part of an MoE's experts") &&
                has(e, c.split == Split::Ep ? "split over the expert-parallel group"
                                            : "FFN split over the tensor-parallel group") &&
                has(e, "TrainerWiring::mesh"))
        << "rank " << r << ": " << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Moe, SplitExpertsOutsideTheMesh, ::testing::ValuesIn(cases()), case_name);

// The mesh's wiring with the MoE layers of `stage` and `experts` as the
// synchronizer's expert list.
void wire_mesh(const DeviceMesh& mesh, torch::nn::Sequential stage,
               std::vector<torch::Tensor> experts) {
  GradientSynchronizerOptions so;
  so.expert_parameters = std::move(experts);
  GradientSynchronizer sync(mesh, stage.ptr(), {}, torch::Tensor(), so);
  pipeline::PipelineRuntime rt(mesh["pp"], {pipeline::PipelineStage(0, stage)},
                               pipeline::Schedule1F1B(1, 2), mse);
  torch::optim::SGD opt(rt.parameters(), torch::optim::SGDOptions(0.1));
  TrainerWiring::mesh(mesh, rt, opt, sync);
}

DeviceMesh ep_mesh(std::shared_ptr<Communicator> world) {
  return init_device_mesh(world, {1, 1, world->size(), 1}, {"pp", "dp", "ep", "tp"});
}

class MoeOnTheMesh : public ::testing::TestWithParam<EngineWorld> {
 protected:
  // Every rank's error from `fn`; "accepted" where the wiring was made.
  std::vector<std::string> run(const std::function<void(std::shared_ptr<Communicator>)>& fn) {
    auto o = options_for(GetParam());
    o.timeout = std::chrono::seconds(5);
    return errors_on_every_rank(
        GetParam().world,
        [&](std::shared_ptr<Communicator> world) {
          torch::set_num_threads(1);
          fn(world);
          throw std::runtime_error("accepted");
        },
        o);
  }
};

// ep_group = the world on a mesh of dp alone: the synchronizer would take
// the ep ranks for replicas and average different experts together.
TEST_P(MoeOnTheMesh, ExpertsOverAGroupTheMeshHasNoEpFor) {
  const int n = GetParam().world;
  const auto errors = run([](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {1, world->size(), 1}, {"pp", "dp", "tp"});
    torch::nn::Sequential stage(MoE(options(Split::Ep, world)));
    wire_mesh(mesh, stage, expert_parameters(*stage));
  });
  for (const auto& e : errors) {
    if (n == 1) {
      EXPECT_EQ(e, "accepted");
      continue;
    }
    EXPECT_TRUE(has(e,
                    "TrainerWiring::mesh: MoE 'stage0.0' splits its experts over its "
                    "expert-parallel group"))
        << e;
    EXPECT_TRUE(has(e, "of " + std::to_string(n) + " ranks")) << e;
    EXPECT_TRUE(has(e, "has \"ep\" of 1")) << e;
  }
}

// Whole experts on every rank of a mesh with ep above 1: the synchronizer
// would divide their gradients by ep without summing over it.
TEST_P(MoeOnTheMesh, ExpertsOverNoGroupOnAMeshWithEp) {
  const int n = GetParam().world;
  const auto errors = run([](std::shared_ptr<Communicator> world) {
    torch::nn::Sequential stage(MoE(options(Split::Ep, nullptr)));
    wire_mesh(ep_mesh(world), stage, expert_parameters(*stage));
  });
  for (const auto& e : errors) {
    if (n == 1) {
      EXPECT_EQ(e, "accepted");
      continue;
    }
    EXPECT_TRUE(has(e,
                    "MoE 'stage0.0' has no expert-parallel group (its experts whole on every "
                    "rank)"))
        << e;
    EXPECT_TRUE(has(e, "has \"ep\" of " + std::to_string(n))) << e;
  }
}

// Two MoE layers over the mesh, the list naming the first's experts only:
// the second's would be averaged over "ep" with other experts.
TEST_P(MoeOnTheMesh, ExpertListMissingALayer) {
  const auto errors = run([](std::shared_ptr<Communicator> world) {
    auto mesh = ep_mesh(world);
    MoE first(mesh, options(Split::Ep, nullptr)), second(mesh, options(Split::Ep, nullptr));
    torch::nn::Sequential stage(first, second);
    wire_mesh(mesh, stage, expert_parameters(*first));
  });
  for (const auto& e : errors) {
    EXPECT_TRUE(has(e, "GradientSynchronizerOptions::expert_parameters")) << e;
  }
}

// The router listed as an expert: its gradient would be summed over the
// replicas only, missing the other ep ranks' tokens.
TEST_P(MoeOnTheMesh, ExpertListWithADenseParameter) {
  const auto errors = run([](std::shared_ptr<Communicator> world) {
    auto mesh = ep_mesh(world);
    MoE moe(mesh, options(Split::Ep, nullptr));
    torch::nn::Sequential stage(moe);
    auto listed = expert_parameters(*moe);
    listed.push_back(moe->router);
    wire_mesh(mesh, stage, listed);
  });
  for (const auto& e : errors) {
    EXPECT_TRUE(has(e, "TrainerWiring::mesh: GradientSynchronizerOptions::expert_parameters")) << e;
    EXPECT_TRUE(has(e, "'stage0.0.router' is no expert")) << e;
  }
}

// The layers built over the mesh with their experts listed: wired.
TEST_P(MoeOnTheMesh, LayersOverTheMeshWithTheirExperts) {
  const auto errors = run([](std::shared_ptr<Communicator> world) {
    auto mesh = ep_mesh(world);
    MoE first(mesh, options(Split::Ep, nullptr)), second(mesh, options(Split::Ep, nullptr));
    torch::nn::Sequential stage(first, second);
    wire_mesh(mesh, stage, expert_parameters(*stage));
  });
  for (const auto& e : errors) EXPECT_EQ(e, "accepted");
}

// An MoE without a sequence group on a mesh with cp above 1: its
// load-balancing loss would cover each cp rank's part of the sequences only.
// Built over the mesh (which takes "cp" for its sequence group) it is wired.
TEST_P(MoeOnTheMesh, NoSequenceGroupOnAMeshWithCp) {
  const int n = GetParam().world;
  const auto cp_mesh = [](std::shared_ptr<Communicator> world) {
    return init_device_mesh(world, {1, 1, world->size(), 1}, {"pp", "dp", "cp", "tp"});
  };
  auto errors = run([&](std::shared_ptr<Communicator> world) {
    torch::nn::Sequential stage(MoE(options(Split::Ep, nullptr)));
    wire_mesh(cp_mesh(world), stage, expert_parameters(*stage));
  });
  for (const auto& e : errors) {
    if (n == 1) {
      EXPECT_EQ(e, "accepted");
      continue;
    }
    EXPECT_TRUE(has(e,
                    "MoE 'stage0.0' has no sequence group (its load-balancing loss over this "
                    "rank's tokens only)"))
        << e;
    EXPECT_TRUE(has(e, "has \"cp\" of " + std::to_string(n))) << e;
  }
  errors = run([&](std::shared_ptr<Communicator> world) {
    const auto mesh = cp_mesh(world);
    torch::nn::Sequential stage(MoE(mesh, options(Split::Ep, nullptr)));
    wire_mesh(mesh, stage, expert_parameters(*stage));
  });
  for (const auto& e : errors) EXPECT_EQ(e, "accepted");
}

INSTANTIATE_TEST_SUITE_P(Moe, MoeOnTheMesh, ::testing::ValuesIn(engine_worlds({1, 2, 3})),
                         engine_world_name);

}  // namespace
}  // namespace cohort::testing::moe_groups_test
