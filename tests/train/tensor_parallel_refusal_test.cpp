// What the Trainer cannot do with a model of tensor-parallel layers outside
// a mesh refuses it on every rank, at dp × tp = 1×2 and 3×2 (ranks as
// threads): ZeRO (alone or over DDP), the fused optimizer and a pipeline,
// whose norms and checkpoints take each tensor for whole; a checkpoint_dir
// under FSDP, DDP or the all-reduce wiring (one Trainer per TP rank: every
// TP rank would write its slices under the whole tensors' names); FSDP's
// WorldSizeInvariant (its canonical norm counts one TP rank's shards);
// sequence-parallel layers (their replicated parameters' gradients need a
// sum over TP); TP layers over two groups; and dcp::get_state_dict of a
// fully sharded model of TP layers. TP layers over a group of one rank hold
// whole tensors and are refused by none of these
// (tensor_parallel_one_test.cpp).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "support/rank_errors.h"
#include "support/subprocess.h"
#include "tests/fsdp/fsdp_tp_model.h"

namespace cohort::tensor_parallel_refusal_test {
namespace {

using namespace cohort::testing::fsdp_tp;
using torch::nn::Sequential;

enum class Mode {
  Zero,
  ZeroOverDdp,
  Fused,
  Pipeline,
  FsdpCheckpoint,
  DdpCheckpoint,
  AllReduceCheckpoint,
};

const char* mode_name(Mode mode) {
  const char* names[] = {
      "zero",           "zero_over_ddp",        "fused", "pipeline", "fsdp_checkpoint",
      "ddp_checkpoint", "all_reduce_checkpoint"};
  return names[static_cast<int>(mode)];
}

struct Case {
  Mode mode;
  int dp, tp;
};

std::string case_text(const Case& c) {
  return std::string(mode_name(c.mode)) + "_dp" + std::to_string(c.dp) + "_tp" +
         std::to_string(c.tp);
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

torch::Tensor mse(const pipeline::Tensors& out, const pipeline::Tensors& target) {
  return torch::nn::functional::mse_loss(out[0], target[0]);
}

torch::Tensor no_loss(const torch::data::Example<>&) { return torch::Tensor(); }

// A Trainer over `wiring` with a checkpoint folder.
void train_with_checkpoints(TrainerWiring wiring) {
  testing::TempDir dir("cohort-tp-refusal");
  TrainerOptions config;
  config.checkpoint_dir = dir.path();
  config.progress = false;
  Trainer trainer(std::move(wiring), no_loss, config);
}

// Builds `mode`'s parts over this rank's TP model and wires it.
void wire(Mode mode, const DeviceMesh& mesh) {
  const auto dp = mesh["dp"].process_group(), tp = mesh["tp"].process_group();
  const auto sgd = torch::optim::SGDOptions(0.1);
  auto seq = make_tp_model(tp, mode == Mode::FsdpCheckpoint ? dp : nullptr, {});
  switch (mode) {
    case Mode::Zero: {
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(seq->parameters(), dp, sgd);
      TrainerWiring::zero(seq.ptr(), *zero);
      break;
    }
    case Mode::ZeroOverDdp: {
      DistributedDataParallel<Sequential> ddp(seq, dp);
      auto zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(ddp, sgd);
      TrainerWiring::ddp(ddp, *zero);
      break;
    }
    case Mode::Fused: {
      FusedDistributedOptimizer fused(seq->parameters(), dp, torch::optim::AdamWOptions(1e-2));
      TrainerWiring::fused(seq.ptr(), fused);
      break;
    }
    case Mode::Pipeline: {
      auto pp_dp = init_device_mesh(dp, {1, dp->size()}, {"pp", "dp"});
      pipeline::PipelineRuntime rt(pp_dp["pp"], {pipeline::PipelineStage(0, seq)},
                                   pipeline::Schedule1F1B(1, 2), mse);
      torch::optim::SGD opt(rt.parameters(), sgd);
      if (dp->size() == 1) {
        TrainerWiring::pipeline(rt, opt);
      } else {
        TrainerWiring::pipeline(rt, opt, pp_dp);
      }
      break;
    }
    case Mode::FsdpCheckpoint: {
      auto root = fully_shard(seq, dp);
      torch::optim::SGD opt(root->parameters(), sgd);
      train_with_checkpoints(TrainerWiring::fsdp(root, opt));
      break;
    }
    case Mode::DdpCheckpoint: {
      DistributedDataParallel<Sequential> ddp(seq, dp);
      torch::optim::SGD opt(seq->parameters(), sgd);
      train_with_checkpoints(TrainerWiring::ddp(ddp, opt));
      break;
    }
    case Mode::AllReduceCheckpoint: {
      torch::optim::SGD opt(seq->parameters(), sgd);
      train_with_checkpoints(TrainerWiring::all_reduce(seq.ptr(), opt, dp));
      break;
    }
  }
}

// What each refusal says besides naming TrainerWiring::mesh.
std::string why(Mode mode) {
  switch (mode) {
    case Mode::Zero:
      return "TrainerWiring::zero on rank ";
    case Mode::ZeroOverDdp:
      return "TrainerWiring::ddp on rank ";
    case Mode::Fused:
      return "TrainerWiring::fused on rank ";
    case Mode::Pipeline:
      return "TrainerWiring::pipeline on rank ";
    default:
      return ": checkpoint_dir with ";
  }
}

class TensorParallelOutsideTheMesh : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelOutsideTheMesh, IsRefusedOnEveryRank) {
  const Case c = GetParam();
  const auto errors =
      testing::errors_on_every_rank(c.dp * c.tp, [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        wire(c.mode, init_device_mesh(world, {c.dp, c.tp}, {"dp", "tp"}));
      });
  for (size_t r = 0; r < errors.size(); ++r) {
    EXPECT_TRUE(has(errors[r], why(c.mode)) && has(errors[r], "tensor-parallel layers") &&
                has(errors[r], "TrainerWiring::mesh"))
        << "rank " << r << ": " << errors[r];
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Mode mode : {Mode::Zero, Mode::ZeroOverDdp, Mode::Fused, Mode::Pipeline,
                    Mode::FsdpCheckpoint, Mode::DdpCheckpoint, Mode::AllReduceCheckpoint}) {
    for (const auto& [dp, tp] : std::vector<std::pair<int, int>>{{1, 2}, {3, 2}}) {
      out.push_back({mode, dp, tp});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, TensorParallelOutsideTheMesh, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

// Every rank's error from fn(mesh) at dp 3 × tp 2.
std::vector<std::string> errors_at_3x2(const std::function<void(const DeviceMesh&)>& fn) {
  return testing::errors_on_every_rank(6, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    fn(init_device_mesh(world, {3, 2}, {"dp", "tp"}));
  });
}

void expect_every_rank(const std::vector<std::string>& errors,
                       const std::vector<std::string>& parts) {
  for (size_t r = 0; r < errors.size(); ++r) {
    for (const auto& part : parts) {
      EXPECT_TRUE(has(errors[r], part)) << "rank " << r << " lacks '" << part << "': " << errors[r];
    }
  }
}

TEST(TensorParallelOutsideTheMesh, FsdpWorldSizeInvariantIsRefused) {
  expect_every_rank(errors_at_3x2([](const DeviceMesh& mesh) {
                      const auto dp = mesh["dp"].process_group();
                      FullyShardOptions o;
                      o.determinism = Determinism::WorldSizeInvariant;
                      o.leaves = 6;
                      auto root =
                          fully_shard(make_tp_model(mesh["tp"].process_group(), dp, o), dp, o);
                      torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.1));
                      TrainerWiring::fsdp(root, opt);
                    }),
                    {"TrainerWiring::fsdp on rank ", "WorldSizeInvariant"});
}

TEST(TensorParallelOutsideTheMesh, SequenceParallelLayersAreRefused) {
  expect_every_rank(
      errors_at_3x2([](const DeviceMesh& mesh) {
        tensor_parallel::ColumnParallelLinearOptions o;
        o.sequence_parallel = true;
        Sequential seq(tensor_parallel::ColumnParallelLinear(mesh["tp"], kWidth, kHidden, o));
        DistributedDataParallel<Sequential> ddp(seq, mesh["dp"].process_group());
        torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.1));
        TrainerWiring::ddp(ddp, opt);
      }),
      {"TrainerWiring::ddp on rank ", "'model.0' is sequence-parallel", "TrainerWiring::mesh"});
}

TEST(TensorParallelOutsideTheMesh, LayersOverTwoGroupsAreRefused) {
  expect_every_rank(errors_at_3x2([](const DeviceMesh& mesh) {
                      // The same ranks, but another communicator.
                      auto other = mesh["tp"].process_group()->split(0, mesh.local_rank("tp"));
                      Sequential seq(TpBlock(mesh["tp"].process_group(), 1), TpBlock(other, 3));
                      torch::optim::SGD opt(seq->parameters(), torch::optim::SGDOptions(0.1));
                      TrainerWiring::all_reduce(seq.ptr(), opt, mesh["dp"].process_group());
                    }),
                    {"TrainerWiring::all_reduce on rank ", "'model.0.col' and 'model.1.col'"});
}

TEST(TensorParallelOutsideTheMesh, FsdpStateDictIsRefused) {
  expect_every_rank(errors_at_3x2([](const DeviceMesh& mesh) {
                      const auto dp = mesh["dp"].process_group();
                      auto root =
                          fully_shard(make_tp_model(mesh["tp"].process_group(), dp, {}), dp);
                      torch::optim::SGD opt(root->parameters(), torch::optim::SGDOptions(0.1));
                      dcp::get_state_dict(root, opt);
                    }),
                    {"dcp::get_state_dict", "tensor-parallel layers"});
}

}  // namespace
}  // namespace cohort::tensor_parallel_refusal_test
