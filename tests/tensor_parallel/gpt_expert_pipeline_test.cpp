// The GPT with experts run through a pipeline of model chunks (pp 1,
// virtual_stages v, interleaved; the PipelineRuntime computes each chunk's
// gradients on their own, stopping at the chunk's input): every MoE's
// load-balancing loss must reach its own router and the layers below it,
// whichever chunk it sits in. One step's gradients (after
// GradientSynchronizer::synchronize, over dp ranks) equal one process's that
// runs the micro-batches one after another through the unsplit model, each
// loss divided by their number, within 1e-5 of each gradient's largest
// element. At v 1 the loss's own chunk holds every MoE: a control.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "cohort/mesh/gradient_synchronizer.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/thread_ranks.h"

namespace cohort::testing::gpt_expert_pipeline_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kBatch = 12;  // global: divides into dp x kMicro micro-batches (dp 1, 2, 3)
constexpr int kMicro = 2;       // per rank

struct Case {
  int dp, v;
  int64_t layers;
};

// MoE in the odd layers. Four layers at v 2: one in each chunk (chunk 0's
// graph reaches the tied embedding, a parameter of the last chunk); three at
// v 3: one in the middle chunk only.
GPTConfig config(int v, int64_t layers) {
  GPTConfig c;
  c.vocab_size = 12;
  c.seq_len = 6;
  c.hidden = 16;
  c.heads = 4;
  c.layers = layers;
  c.virtual_stages = v;
  c.seed = 7;
  c.experts = 4;
  c.top_k = 2;
  c.capacity_factor = 1.0;
  c.aux_loss_coef = 0.5;  // large, so that a lost load-balancing gradient shows
  return c;
}

std::pair<torch::Tensor, torch::Tensor> batch(const GPTConfig& c) {
  auto ids = torch::randint(c.vocab_size, {kBatch, c.seq_len}, at::detail::createCPUGenerator(31));
  return {ids, (ids * 5 + 3) % c.vocab_size};
}

using Gradients = std::map<std::string, torch::Tensor>;

// One process, the unsplit model: the dp x kMicro micro-batches in turn.
Gradients reference(int dp, int64_t layers) {
  Gradients out;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, 1}, {"pp", "dp", "tp"});
    const auto c = config(1, layers);
    GPTStage stage(mesh, c);
    auto [ids, targets] = batch(c);
    const int64_t n = dp * kMicro, rows = kBatch / n;
    for (int64_t j = 0; j < n; ++j) {
      (stage->loss(stage(ids.narrow(0, j * rows, rows)), targets.narrow(0, j * rows, rows)) / n)
          .backward();
    }
    for (const auto& p : stage->named_parameters()) out[p.key()] = p.value().grad().clone();
  });
  return out;
}

// The pipeline at (dp, v): rank 0's gradients after one step.
Gradients pipelined(const Case& k) {
  Gradients out;
  std::mutex mu;
  run_ranks_shared(k.dp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, k.dp, 1}, {"pp", "dp", "tp"});
    const auto c = config(k.v, k.layers);
    GPTStage stage(mesh, c);
    cohort::GradientSynchronizerOptions options;
    options.expert_parameters = stage->expert_parameters();
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight(),
                                      options);
    auto rt = make_gpt_pipeline(mesh, stage, "interleaved", kMicro);
    auto [ids, targets] = batch(c);
    const int64_t rows = kBatch / k.dp, d = mesh.local_rank("dp");
    rt->step({ids.narrow(0, d * rows, rows)}, {targets.narrow(0, d * rows, rows)});
    sync.synchronize();
    if (world->rank() != 0) return;
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : stage->named_parameters()) {
      out[p.key()] = p.value().grad().defined() ? p.value().grad().clone() : torch::Tensor();
    }
  });
  return out;
}

class GPTExpertPipeline : public ::testing::TestWithParam<Case> {};

TEST_P(GPTExpertPipeline, EveryChunksLoadBalancingLossReachesItsRouter) {
  const Case k = GetParam();
  const auto want = reference(k.dp, k.layers);
  const auto got = pipelined(k);
  ASSERT_EQ(got.size(), want.size());
  int checked = 0;
  for (const auto& [name, g] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    const auto& h = got.at(name);
    ASSERT_TRUE(h.defined()) << name;
    const double scale = std::max(g.abs().max().item<double>(), 1e-12);
    EXPECT_LE((h - g).abs().max().item<double>() / scale, 1e-5)
        << name << ": " << (h - g).abs().max().item<double>() << " off, largest element " << scale;
    checked += name.find(".moe.router") != std::string::npos;
  }
  EXPECT_EQ(checked, k.layers / 2) << "routers";
}

INSTANTIATE_TEST_SUITE_P(Layouts, GPTExpertPipeline,
                         ::testing::Values(Case{1, 1, 4}, Case{1, 2, 4}, Case{2, 2, 4},
                                           Case{3, 2, 4}, Case{1, 3, 3}, Case{2, 3, 3}),
                         [](const auto& info) {
                           return "dp" + std::to_string(info.param.dp) + "_v" +
                                  std::to_string(info.param.v) + "_layers" +
                                  std::to_string(info.param.layers);
                         });

}  // namespace
}  // namespace cohort::testing::gpt_expert_pipeline_test
