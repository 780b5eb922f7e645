// Tensor-parallel layers over a TP group of one rank (tp = 1: one model code
// for every layout) hold whole tensors, as plain layers do, so every wiring
// that refuses TP layers over two or more ranks trains and checkpoints them:
// ZeRO (alone or over DDP), the fused optimizer, a pipeline, FSDP (also with
// WorldSizeInvariant, and its dcp::get_state_dict), DDP and the all-reduce
// wiring with a checkpoint_dir, sequence-parallel layers, and layers over
// two groups of one. At dp 1 and 3 (ranks as threads) each trains two
// clipped steps, saves, resumes into a model drawn from other seeds and
// trains two more; every step's norm is that of one process training the
// same model made of torch::nn::Linear layers on the whole batch, and the
// parameters end as its, both within 1e-6 relative.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/optim/fused_distributed_optimizer.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "golden_run.h"
#include "support/subprocess.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"
#include "train_fixtures.h"

namespace cohort::tensor_parallel_one_test {
namespace {

namespace fsdp_test = cohort::testing::fsdp_test;
using fsdp_test::Named;
using torch::nn::Sequential;

constexpr int64_t kWidth = 10, kHidden = 20, kBatch = 12;  // 12 divides by 1, 2, 3 and 6
constexpr int kSteps = 4, kSaveAt = 2, kLeaves = 6;
constexpr double kMaxNorm = 0.05;

enum class Mode {
  Zero,
  ZeroOverDdp,
  Fused,
  Pipeline,
  Fsdp,
  FsdpWorldSizeInvariant,
  Ddp,
  AllReduce,
  DdpSequenceParallel,
  AllReduceTwoGroups,
};

const char* mode_name(Mode mode) {
  const char* names[] = {"zero",
                         "zero_over_ddp",
                         "fused",
                         "pipeline",
                         "fsdp",
                         "fsdp_world_size_invariant",
                         "ddp",
                         "all_reduce",
                         "ddp_sequence_parallel",
                         "all_reduce_two_groups"};
  return names[static_cast<int>(mode)];
}

struct Case {
  Mode mode;
  int dp;
};

std::string case_text(const Case& c) {
  return std::string(mode_name(c.mode)) + "_dp" + std::to_string(c.dp);
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_text(c); }

// The fused optimizer steps AdamW alone; the others SGD with momentum, whose
// step shows a wrong gradient scale that AdamW's would hide.
bool adamw(Mode mode) { return mode == Mode::Fused; }

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Mode mode,
                                                        std::vector<torch::Tensor> params) {
  if (adamw(mode)) {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
  }
  return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.05).momentum(0.9));
}

// How the TP layers of a block are built; kPlain: torch::nn::Linear.
enum class Layers { kPlain, kTp, kSequenceParallel };

// x + row(tanh(col(x))), col and row drawn from `seed` and `seed + 1` as the
// TP layers draw their full weights.
struct BlockImpl : torch::nn::Module {
  std::function<torch::Tensor(const torch::Tensor&)> col_fn, row_fn;

  BlockImpl(Layers layers, const std::shared_ptr<Communicator>& group, uint64_t seed) {
    if (layers == Layers::kPlain) {
      auto col = register_module("col", torch::nn::Linear(kWidth, kHidden));
      auto row = register_module("row", torch::nn::Linear(kHidden, kWidth));
      torch::NoGradGuard no_grad;
      auto [cw, cb] = tensor_parallel::master_linear_weights(kWidth, kHidden, seed);
      auto [rw, rb] = tensor_parallel::master_linear_weights(kHidden, kWidth, seed + 1);
      col->weight.copy_(cw);
      col->bias.copy_(cb);
      row->weight.copy_(rw);
      row->bias.copy_(rb);
      col_fn = [col](const torch::Tensor& x) { return col->forward(x); };
      row_fn = [row](const torch::Tensor& x) { return row->forward(x); };
      return;
    }
    const auto tp = DeviceMesh::from_group(group, "tp");
    tensor_parallel::ColumnParallelLinearOptions c;
    c.seed = seed;
    c.sequence_parallel = layers == Layers::kSequenceParallel;
    tensor_parallel::RowParallelLinearOptions r;
    r.seed = seed + 1;
    r.sequence_parallel = c.sequence_parallel;
    auto col =
        register_module("col", tensor_parallel::ColumnParallelLinear(tp, kWidth, kHidden, c));
    auto row = register_module("row", tensor_parallel::RowParallelLinear(tp, kHidden, kWidth, r));
    col_fn = [col](const torch::Tensor& x) { return col->forward(x); };
    row_fn = [row](const torch::Tensor& x) { return row->forward(x); };
  }
  torch::Tensor forward(const torch::Tensor& x) { return x + row_fn(torch::tanh(col_fn(x))); }
};
TORCH_MODULE(Block);

// Two blocks and a linear head, drawn from `base`; the second block over
// `second` (the first's group when null); `dp` given: each block an FSDP unit.
Sequential make_model(Layers layers, const std::shared_ptr<Communicator>& tp,
                      std::shared_ptr<Communicator> second, const std::shared_ptr<Communicator>& dp,
                      const FullyShardOptions& o, uint64_t base) {
  auto unit = [&](Block b) {
    return dp ? torch::nn::AnyModule(FullyShard(torch::nn::AnyModule(b), dp, o))
              : torch::nn::AnyModule(b);
  };
  Sequential seq;
  seq->push_back(unit(Block(layers, tp, base + 11)));
  seq->push_back(unit(Block(layers, second ? second : tp, base + 21)));
  auto head = torch::nn::Linear(kWidth, kWidth);
  fsdp_test::init_parameters(*head, base + 5);
  seq->push_back(head);
  return seq;
}

using Data = testing::StepBatches;

Data make_data() { return testing::make_step_batches(kSteps, kBatch, kWidth, kWidth); }

using RankRun = testing::GoldenRun;

// One process, torch::nn::Linear layers, the whole batch: clipped by
// torch::nn::utils::clip_grad_norm_'s rule, the norm summed in float64.
RankRun reference_run(Mode mode, const Data& d) {
  auto model = make_model(Layers::kPlain, nullptr, nullptr, nullptr, {}, 0);
  auto opt = make_optimizer(mode, model->parameters());
  RankRun ref;
  for (int s = 0; s < kSteps; ++s) {
    opt->zero_grad();
    torch::mse_loss(model->forward(d.x[s]), d.y[s]).backward();
    double squares = 0;
    for (const auto& p : model->parameters()) {
      squares += p.grad().to(torch::kFloat64).pow(2).sum().item<double>();
    }
    const double norm = std::sqrt(squares), coef = kMaxNorm / (norm + 1e-6);
    EXPECT_LT(coef, 1) << "the test must exercise clipping, step " << s;
    ref.norms.push_back(norm);
    torch::NoGradGuard no_grad;
    for (auto& p : model->parameters()) p.grad().mul_(coef);
    opt->step();
  }
  for (const auto& p : model->named_parameters()) {
    ref.params.insert(p.key(), p.value().detach().clone());
  }
  return ref;
}

torch::Tensor mse(const pipeline::Tensors& out, const pipeline::Tensors& target) {
  return torch::nn::functional::mse_loss(out[0], target[0]);
}

// This rank's Trainer of `mode` over a model of TP layers over `mesh`'s
// "tp" (of one rank), drawn from `base`, with every part it needs.
struct Wired {
  Sequential seq{nullptr};
  FullyShard root{nullptr};
  std::unique_ptr<DistributedDataParallel<Sequential>> ddp;
  std::unique_ptr<torch::optim::Optimizer> opt;
  std::unique_ptr<ZeroRedundancyOptimizer> zero;
  std::unique_ptr<FusedDistributedOptimizer> fused;
  std::optional<DeviceMesh> pp_dp;
  std::unique_ptr<pipeline::PipelineRuntime> rt;
  std::optional<Trainer> trainer;

  Wired(Mode mode, const DeviceMesh& mesh, const std::string& dir, uint64_t base) {
    const auto dp = mesh["dp"].process_group(), tp = mesh["tp"].process_group();
    const bool fsdp = mode == Mode::Fsdp || mode == Mode::FsdpWorldSizeInvariant;
    TrainerOptions config;
    config.max_grad_norm = kMaxNorm;
    config.accumulation_steps = 2;
    config.checkpoint_dir = dir;
    config.progress = false;
    FullyShardOptions o;
    if (mode == Mode::FsdpWorldSizeInvariant) {
      o.determinism = config.determinism = Determinism::WorldSizeInvariant;
      o.leaves = config.leaves = kLeaves;
      config.accumulation_steps = kLeaves / dp->size();
    }
    const auto layers = mode == Mode::DdpSequenceParallel ? Layers::kSequenceParallel : Layers::kTp;
    // Another group of the same (one) rank.
    auto second = mode == Mode::AllReduceTwoGroups ? tp->split(0, mesh.local_rank("tp")) : nullptr;
    seq = make_model(layers, tp, second, fsdp ? dp : nullptr, o, base);
    std::optional<TrainerWiring> wiring;
    std::function<torch::Tensor(const torch::Tensor&)> forward = [this](const torch::Tensor& x) {
      return seq->forward(x);
    };
    switch (mode) {
      case Mode::Zero:
        zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(
            seq->parameters(), dp, torch::optim::SGDOptions(0.05).momentum(0.9));
        wiring.emplace(TrainerWiring::zero(seq.ptr(), *zero));
        break;
      case Mode::ZeroOverDdp:
        ddp = std::make_unique<DistributedDataParallel<Sequential>>(seq, dp);
        zero = ZeroRedundancyOptimizer::make<torch::optim::SGD>(
            *ddp, torch::optim::SGDOptions(0.05).momentum(0.9));
        wiring.emplace(TrainerWiring::ddp(*ddp, *zero));
        forward = [this](const torch::Tensor& x) { return ddp->forward(x); };
        break;
      case Mode::Fused:
        fused = std::make_unique<FusedDistributedOptimizer>(
            seq->parameters(), dp, torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
        wiring.emplace(TrainerWiring::fused(seq.ptr(), *fused));
        break;
      case Mode::Pipeline:
        pp_dp = init_device_mesh(dp, {1, dp->size()}, {"pp", "dp"});
        rt = std::make_unique<pipeline::PipelineRuntime>(
            (*pp_dp)["pp"], std::vector<pipeline::PipelineStage>{pipeline::PipelineStage(0, seq)},
            pipeline::Schedule1F1B(1, 2), mse);
        opt = make_optimizer(mode, rt->parameters());
        wiring.emplace(dp->size() == 1 ? TrainerWiring::pipeline(*rt, *opt)
                                       : TrainerWiring::pipeline(*rt, *opt, *pp_dp));
        break;
      case Mode::Fsdp:
      case Mode::FsdpWorldSizeInvariant:
        root = fully_shard(seq, dp, o);
        opt = make_optimizer(mode, root->parameters());
        wiring.emplace(TrainerWiring::fsdp(root, *opt));
        forward = [this](const torch::Tensor& x) { return root->forward(x); };
        break;
      case Mode::Ddp:
      case Mode::DdpSequenceParallel:
        ddp = std::make_unique<DistributedDataParallel<Sequential>>(seq, dp);
        opt = make_optimizer(mode, seq->parameters());
        wiring.emplace(TrainerWiring::ddp(*ddp, *opt));
        forward = [this](const torch::Tensor& x) { return ddp->forward(x); };
        break;
      case Mode::AllReduce:
      case Mode::AllReduceTwoGroups:
        opt = make_optimizer(mode, seq->parameters());
        wiring.emplace(TrainerWiring::all_reduce(seq.ptr(), *opt, dp));
        break;
    }
    if (mode == Mode::Pipeline) {
      trainer.emplace(std::move(*wiring), config);
    } else {
      LossFn loss = [forward](const torch::data::Example<>& b) {
        return torch::mse_loss(forward(b.data), b.target);
      };
      trainer.emplace(std::move(*wiring), loss, config);
    }
  }

  // This rank's micro-batches of step s: its rows of the global batch.
  double step(const Data& d, int s, const Communicator& dp) {
    const auto x = fsdp_test::local(d.x[s], dp), y = fsdp_test::local(d.y[s], dp);
    const int64_t k = trainer->config().accumulation_steps;
    std::vector<torch::data::Example<>> micro;
    for (int64_t i = 0; i < k; ++i) micro.push_back({x.chunk(k)[i], y.chunk(k)[i]});
    return trainer->train_step(micro).grad_norm;
  }

  Named params() {
    if (!root.is_empty()) return root->full_state_dict();
    Named out;
    for (const auto& p : seq->named_parameters()) out.insert(p.key(), p.value().detach().clone());
    return out;
  }
};

class TensorParallelOfOneRank : public ::testing::TestWithParam<Case> {};

TEST_P(TensorParallelOfOneRank, TrainsSavesAndResumesAsPlainLayers) {
  const Case c = GetParam();
  const auto data = make_data();
  const RankRun ref = reference_run(c.mode, data);
  testing::TempDir dir("cohort-tp-one");
  std::mutex mu;
  std::map<int, RankRun> runs;
  testing::run_ranks_shared(c.dp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    const auto mesh = init_device_mesh(world, {c.dp, 1}, {"dp", "tp"});
    const auto& dp = *mesh["dp"].process_group();
    RankRun run;
    {
      Wired w(c.mode, mesh, dir.path(), 0);
      for (int s = 0; s < kSaveAt; ++s) run.norms.push_back(w.step(data, s, dp));
      w.trainer->save_checkpoint();
    }
    // Other initial weights: only the checkpoint makes it the same model.
    Wired w(c.mode, mesh, dir.path(), 100);
    const auto resumed = w.trainer->resume();
    EXPECT_EQ(resumed, std::optional<int64_t>(kSaveAt)) << "rank " << world->rank();
    for (int s = kSaveAt; s < kSteps; ++s) run.norms.push_back(w.step(data, s, dp));
    run.params = w.params();
    std::lock_guard<std::mutex> lock(mu);
    runs[world->rank()] = std::move(run);
  });
  testing::expect_golden(runs, ref, c.dp, kSteps);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Mode mode : {Mode::Zero, Mode::ZeroOverDdp, Mode::Fused, Mode::Pipeline, Mode::Fsdp,
                    Mode::FsdpWorldSizeInvariant, Mode::Ddp, Mode::AllReduce,
                    Mode::DdpSequenceParallel, Mode::AllReduceTwoGroups}) {
    for (int dp : {1, 3}) out.push_back({mode, dp});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Trainer, TensorParallelOfOneRank, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return case_text(info.param);
                         });

}  // namespace
}  // namespace cohort::tensor_parallel_one_test
