// A tied weight split by tensor parallelism (Megatron's shared word
// embedding at pp > 1 and tp > 1): the first stage looks ids up in a
// VocabParallelEmbedding, the last multiplies by its own copy of the table
// for its vocabulary shard of the logits, and both declare the table tied
// (PipelineStage::tie). Over TrainerWiring::mesh with AdamW and clipping by
// the global norm, every rank steps its shard as one process steps the one
// table: the runtime sums each shard's copies within the rank's "pp" group
// (one TP coordinate), and MeshGradNorm counts every shard of the table
// once (the last stage's copies are left out, the first stage's shards
// counted on every TP rank).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/tensor_parallel/layers.h"
#include "cohort/tensor_parallel/mappings.h"
#include "cohort/train/tensor_data_source.h"
#include "cohort/train/trainer.h"
#include "cohort/wiring/trainer_wiring.h"
#include "pipeline/pipeline_test_models.h"
#include "support/thread_ranks.h"

namespace cohort::pipeline_tied_tp_test {
namespace {

using namespace cohort::pipeline;
using namespace cohort::pipeline::testing;
using namespace cohort::tensor_parallel;

constexpr int64_t kVocab = 12, kMicro = 2;
constexpr int kSteps = 3;
constexpr double kLr = 0.05, kMaxNorm = 0.05;
constexpr uint64_t kSeed = 11;

struct Case {
  const char* schedule;
  int pp, v, tp, dp, m;
};

std::string name_of(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return std::string(c.schedule) + "_pp" + std::to_string(c.pp) + "_v" + std::to_string(c.v) +
         "_tp" + std::to_string(c.tp) + "_dp" + std::to_string(c.dp) + "_m" + std::to_string(c.m);
}

VocabParallelEmbeddingOptions table_options(uint64_t seed) {
  VocabParallelEmbeddingOptions o;
  o.seed = seed;
  return o;
}

// eps well above rounding: a gradient element near zero (a block weight's
// at four stages) would have its rounding noise, which differs with the
// order of any sum, scaled into steps of lr at eps 1e-8.
torch::optim::AdamW adamw(std::vector<torch::Tensor> params) {
  return torch::optim::AdamW(std::move(params),
                             torch::optim::AdamWOptions(kLr).weight_decay(0.1).eps(1e-4));
}

// Stage s's own square weight (whole on every TP rank).
torch::Tensor block_weight(int s) { return det({kWidth, kWidth}, 3.0 + s); }

// The unsplit model over `stages` stages: h = E[ids], then per stage
// h = tanh(h A_s), logits = h E^T; the loss is the cross-entropy's mean.
struct Reference {
  torch::Tensor table;
  std::vector<torch::Tensor> blocks;
  std::vector<torch::Tensor> parameters() const {
    std::vector<torch::Tensor> out{table};
    out.insert(out.end(), blocks.begin(), blocks.end());
    return out;
  }
  torch::Tensor loss(const torch::Tensor& ids, const torch::Tensor& targets) const {
    torch::Tensor h = table.index_select(0, ids);
    for (const auto& a : blocks) h = torch::tanh(h.matmul(a));
    return torch::nn::functional::cross_entropy(h.matmul(table.t()), targets);
  }
};

Reference reference(int stages) {
  Reference r;
  r.table = master_embedding_weight(kVocab, kWidth, table_options(kSeed)).requires_grad_(true);
  for (int s = 0; s < stages; ++s) r.blocks.push_back(block_weight(s).requires_grad_(true));
  return r;
}

struct TpRun {
  std::vector<double> norms, losses;
  std::map<std::string, torch::Tensor> params;  // "table@<stage>" (this TP rank's rows), "a<stage>"
};

TpRun reference_run(int stages, int64_t batch, const torch::Tensor& ids,
                    const torch::Tensor& targets) {
  auto ref = reference(stages);
  auto opt = adamw(ref.parameters());
  TpRun run;
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    auto loss = ref.loss(ids.narrow(0, s * batch, batch), targets.narrow(0, s * batch, batch));
    loss.backward();
    run.norms.push_back(torch::nn::utils::clip_grad_norm_(ref.parameters(), kMaxNorm));
    run.losses.push_back(loss.item<double>());
    opt.step();
  }
  run.params["table"] = ref.table.detach().clone();
  for (int s = 0; s < stages; ++s)
    run.params["a" + std::to_string(s)] = ref.blocks[s].detach().clone();
  return run;
}

// Stage s as a module (so that the mesh's norm and synchronizer see the
// VocabParallelEmbedding): "embedding" on the first stage, "output" (the
// last stage's copy of the table, drawn from another seed: the runtime
// broadcasts the first stage's shard) on the last, "a<s>" on each. Given
// `function_of`, a function stage holding the module's tensors alone, the
// module put there.
PipelineStage tp_stage(int s, int stages, const DeviceMesh& tp,
                       std::shared_ptr<torch::nn::Module>* function_of = nullptr) {
  auto module = std::make_shared<torch::nn::Module>("Stage");
  auto a = module->register_parameter("a" + std::to_string(s), block_weight(s));
  VocabParallelEmbedding embedding{nullptr}, output{nullptr};
  if (s == 0)
    embedding = module->register_module(
        "embedding", VocabParallelEmbedding(tp, kVocab, kWidth, table_options(kSeed)));
  if (s == stages - 1)
    output = module->register_module(
        "output", VocabParallelEmbedding(tp, kVocab, kWidth, table_options(kSeed + 1)));
  auto group = tp.process_group();
  auto forward = [=](const Tensors& in) mutable {
    torch::Tensor h = embedding.is_empty() ? in[0] : embedding(in[0]);
    h = torch::tanh(h.matmul(a));
    // This TP rank's vocabulary columns of the logits; backward sums the
    // ranks' parts of h's gradient.
    if (!output.is_empty())
      h = copy_to_tensor_parallel_region(h, *group).matmul(output->weight.t());
    return Tensors{h};
  };
  if (function_of) *function_of = module;
  PipelineStage stage(s, forward, module->parameters(), function_of ? nullptr : module);
  if (!embedding.is_empty()) stage.tie("table", embedding->weight);
  if (!output.is_empty()) stage.tie("table", output->weight);
  return stage;
}

// Rank = (pp_rank * dp + dp_rank) * tp + tp_rank.
TpRun run_rank(const Case& c, std::shared_ptr<Communicator> world, const torch::Tensor& ids,
               const torch::Tensor& targets) {
  torch::set_num_threads(1);
  auto mesh = init_device_mesh(world, {c.pp, c.dp, c.tp}, {"pp", "dp", "tp"});
  const auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
  const int stages = schedule.num_stages;
  const auto tp = mesh["tp"];
  std::vector<PipelineStage> mine;
  for (int s : schedule.stages_of(mesh.local_rank("pp"))) mine.push_back(tp_stage(s, stages, tp));
  auto holder = std::make_shared<torch::nn::Module>("Stages");
  for (const auto& st : mine)
    holder->register_module("stage" + std::to_string(st.index()), st.module());
  auto tp_group = tp.process_group();
  auto loss_fn = [tp_group](const Tensors& out, const Tensors& target) {
    VocabParallelCrossEntropyOptions mean;
    mean.reduction = CrossEntropyReduction::Mean;
    return vocab_parallel_cross_entropy(out[0], target[0], *tp_group, mean);
  };
  PipelineRuntime rt(mesh["pp"], std::move(mine), schedule, loss_fn);
  auto opt = adamw(rt.parameters());
  GradientSynchronizerOptions options;
  options.untied_embedding = true;  // the table is kept through the declarations
  GradientSynchronizer sync(mesh, holder, {}, torch::Tensor(), options);
  TrainerOptions config;
  config.accumulation_steps = c.m;
  config.max_grad_norm = kMaxNorm;
  config.schedule.base_lr = kLr;
  config.progress = false;
  Trainer trainer(TrainerWiring::mesh(mesh, rt, opt, sync), config);
  TensorDataSource source(ids, targets, kMicro, mesh.local_rank("dp"), c.dp, /*shuffle=*/false);
  TpRun run;
  for (const auto& m : trainer.fit(source)) {
    run.norms.push_back(m.grad_norm);
    run.losses.push_back(m.loss);
  }
  for (const auto& st : rt.stages()) {
    for (const auto& p : st.module()->named_parameters()) {
      const bool table = p.key().find("weight") != std::string::npos;
      run.params[table ? "table@" + std::to_string(st.index()) : p.key()] =
          p.value().detach().clone();
    }
  }
  return run;
}

class PipelineTiedTensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(PipelineTiedTensorParallel, EqualsOneProcessWithClipping) {
  const Case c = GetParam();
  const auto schedule = make_schedule(c.schedule, c.pp, c.v, c.m);
  const int stages = schedule.num_stages;
  const int64_t batch = c.dp * c.m * kMicro;
  const auto ids = (torch::arange(kSteps * batch) * 5 + 3) % kVocab;
  const auto targets = (ids * 3 + 1 + torch::arange(kSteps * batch) % 2) % kVocab;
  const TpRun ref = reference_run(stages, batch, ids, targets);
  const auto runs = cohort::testing::results_of_ranks<TpRun>(
      c.pp * c.dp * c.tp,
      [&](std::shared_ptr<Communicator> world) { return run_rank(c, world, ids, targets); });
  ASSERT_EQ(runs.size(), static_cast<size_t>(c.pp * c.dp * c.tp));
  const int64_t rows = kVocab / c.tp;
  int copies = 0;
  for (const auto& [rank, run] : runs) {
    const std::string where = "rank " + std::to_string(rank);
    ASSERT_EQ(run.norms.size(), static_cast<size_t>(kSteps)) << where;
    for (int s = 0; s < kSteps; ++s) {
      ASSERT_GT(ref.norms[s], kMaxNorm) << "the test must exercise clipping";
      EXPECT_NEAR(run.norms[s], ref.norms[s], 1e-5 * ref.norms[s]) << where << ", step " << s;
      EXPECT_NEAR(run.losses[s], ref.losses[s], 1e-5 * ref.losses[s]) << where << ", step " << s;
    }
    for (const auto& [name, t] : run.params) {
      const bool table = name.rfind("table@", 0) == 0;
      copies += table;
      const torch::Tensor want = table
                                     ? ref.params.at("table").narrow(0, (rank % c.tp) * rows, rows)
                                     : ref.params.at(name);
      const double err = (t - want).abs().max().item<double>();
      EXPECT_LE(err, 1e-5 * want.abs().max().item<double>()) << where << ", " << name;
    }
  }
  EXPECT_EQ(copies, 2 * c.tp * c.dp);  // the first and the last stage's, per TP and DP rank
}

INSTANTIATE_TEST_SUITE_P(Pipeline, PipelineTiedTensorParallel,
                         ::testing::Values(Case{"1f1b", 2, 1, 2, 1, 2},
                                           Case{"gpipe", 3, 1, 2, 1, 3},
                                           Case{"zbh1", 2, 1, 2, 2, 2},
                                           Case{"interleaved", 2, 2, 2, 1, 4},
                                           Case{"1f1b", 2, 1, 3, 1, 2}),
                         name_of);

// Function stages without their modules: the mesh's norm and checkpoint
// cannot see the table's split (they would count and save a shard as the
// whole table), so TrainerWiring::mesh refuses them on every rank.
TEST(PipelineTiedTensorParallelErrors, FunctionStagesWithASplitTensorAreRefusedOnEveryRank) {
  const auto errors = cohort::testing::results_of_ranks<std::string>(
      4, [](std::shared_ptr<Communicator> world) -> std::string {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {2, 1, 2}, {"pp", "dp", "tp"});
        const int s = mesh.local_rank("pp");
        std::shared_ptr<torch::nn::Module> module;
        PipelineRuntime rt(mesh["pp"], {tp_stage(s, 2, mesh["tp"], &module)},
                           make_schedule("1f1b", 2, 1, 2), mse);
        // The synchronizer sees the layers: only the norm and the checkpoint would not.
        auto holder = std::make_shared<torch::nn::Module>("Stages");
        holder->register_module("stage" + std::to_string(s), module);
        GradientSynchronizerOptions options;
        options.untied_embedding = true;
        GradientSynchronizer sync(mesh, holder, {}, torch::Tensor(), options);
        auto opt = adamw(rt.parameters());
        try {
          TrainerWiring::mesh(mesh, rt, opt, sync);
        } catch (const InvalidArgument& e) {
          return e.what();
        }
        return "accepted";
      });
  ASSERT_EQ(errors.size(), 4u);
  for (const auto& [rank, what] : errors)
    EXPECT_NE(what.find("stage 0 is a function whose parameter 1 is TP rank 0 of 2's part"),
              std::string::npos)
        << "rank " << rank << ": " << what;
}

}  // namespace
}  // namespace cohort::pipeline_tied_tp_test
