// PipelineRuntime refusing what would not train or would not meet: a loss
// outside autograd, ranks with different stage-to-rank maps, more stages than
// the message tags can tell apart. Each is an exception on every rank of the
// pipeline, named, never a silent step, a timeout or crossed messages.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/rank_errors.h"

namespace cohort::pipeline::runtime_errors_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::errors_on_every_rank;
using cohort::testing::kNoError;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A function stage y = x * p with one scalar parameter p = 1, so that a
// chain of any length has a closed-form loss and gradient.
struct ScaleStage {
  torch::Tensor p = torch::ones({}, torch::requires_grad());
  PipelineStage stage(int index) const {
    auto param = p;
    return PipelineStage(index, [param](const Tensors& in) { return Tensors{in[0] * param}; },
                         {param});
  }
};

// A compute-only GPipe order on any stage-to-rank map: every forward by
// micro-batch and ascending stage, then every backward by micro-batch and
// descending stage (the runtime adds the transfers).
PipelineSchedule gpipe_on(const std::vector<int>& map, int ranks, int m) {
  PipelineSchedule s;
  s.name = "GPipe on a map";
  s.num_ranks = ranks;
  s.num_stages = static_cast<int>(map.size());
  s.num_microbatches = m;
  s.stage_to_rank = map;
  s.actions.resize(static_cast<size_t>(ranks));
  for (int mb = 0; mb < m; ++mb)
    for (int st = 0; st < s.num_stages; ++st)
      s.actions[map[st]].push_back({st, ActionType::Forward, mb});
  for (int mb = 0; mb < m; ++mb)
    for (int st = s.num_stages - 1; st >= 0; --st)
      s.actions[map[st]].push_back({st, ActionType::Backward, mb});
  return s;
}

std::vector<PipelineStage> scale_stages(const PipelineSchedule& s, int rank,
                                        std::vector<ScaleStage>& params) {
  std::vector<PipelineStage> out;
  for (int st : s.stages_of(rank)) out.push_back(params[static_cast<size_t>(st)].stage(st));
  return out;
}

torch::Tensor mean_product(const Tensors& out, const Tensors& target) {
  return (out[0] * target[0]).mean();
}

class LossWithoutGrad : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

// The loss function detaches its input: before, the step succeeded and no
// parameter got a gradient.
TEST_P(LossWithoutGrad, IsAnErrorOnEveryRank) {
  const auto [name, pp] = GetParam();
  const int m = 2;
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_mlp(pp);
    const int r = comm->rank();
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                       {PipelineStage(r, split_sequential(model, mlp_boundaries(pp), r))},
                       make_schedule(name, pp, 1, m), [](const Tensors& out, const Tensors& y) {
                         return mse(Tensors{out[0].detach()}, y);
                       });
    rt.step({det({2 * m, kWidth}, 0)}, {det({2 * m, kWidth}, 1)});
  });
  const std::string last = std::to_string(pp - 1);
  for (int r = 0; r < pp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e, "the loss of stage " + last + " micro-batch 0 (on rank " + last +
                           ") does not require grad"))
        << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Schedules, LossWithoutGrad,
                         ::testing::Combine(::testing::Values("1f1b", "zbh1"),
                                            ::testing::Values(1, 2, 3)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_pp" +
                                  std::to_string(std::get<1>(info.param));
                         });

// A loss of several elements: the same refusal on every rank (before, only
// the last stage's rank threw and the others waited for its gradients).
TEST(LossNotAScalar, IsAnErrorOnEveryRank) {
  for (int pp : {1, 3}) {
    auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
      auto model = make_mlp(pp);
      const int r = comm->rank();
      PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                         {PipelineStage(r, split_sequential(model, mlp_boundaries(pp), r))},
                         Schedule1F1B(pp, 2), [](const Tensors& out, const Tensors& y) {
                           return (out[0] - y[0]).pow(2).mean(1);  // one loss per row
                         });
      rt.step({det({4, kWidth}, 0)}, {det({4, kWidth}, 1)});
    });
    const std::string last = std::to_string(pp - 1);
    for (int r = 0; r < pp; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of group")) << e;
      EXPECT_TRUE(has(e, "the loss function returned 2 elements for stage " + last +
                             " micro-batch 0 (on rank " + last + "), not a scalar"))
          << e;
    }
  }
}

class StageMapDisagreement : public ::testing::TestWithParam<int> {};

// The last rank places two stages per rank in blocks, the others
// interleaved (stage s on rank s % pp): each rank holds what its own map
// says and the stage counts add up, so only the maps differ.
TEST_P(StageMapDisagreement, IsNamedAtConstruction) {
  const int pp = GetParam();
  const int m = pp;
  std::vector<int> blocks;
  for (int r = 0; r < pp; ++r) blocks.insert(blocks.end(), {r, r});
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto s = r == pp - 1 ? gpipe_on(blocks, pp, m) : ScheduleInterleaved1F1B(pp, 2, m);
    std::vector<ScaleStage> params(2 * static_cast<size_t>(pp));
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), scale_stages(s, r, params), s,
                       mean_product);
    rt.step({torch::ones({m, 1})}, {torch::ones({m, 1})});
  });
  auto text = [](const std::vector<int>& v) {
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "]";
  };
  std::string others = pp == 2 ? "rank 0" : "ranks 0";
  for (int r = 1; r < pp - 1; ++r) others += ", " + std::to_string(r);
  const std::string expected = others + ": " + text(loop_stage_to_rank(pp, 2)) + "; rank " +
                               std::to_string(pp - 1) + ": " + text(blocks);
  for (int r = 0; r < pp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e, "ranks disagree on the stage-to-rank map (" + expected + ")")) << e;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, StageMapDisagreement, ::testing::Values(2, 3),
                         [](const auto& info) { return "pp" + std::to_string(info.param); });

// A tag is 1 + (2 * boundary + direction) * 2^16 + micro-batch and must stay
// below 2^31, a block of 2^16 per (boundary, direction): with S stages the
// last block is 2 * (S - 2) + 1, whose end (its index + 1) * 2^16 stays below
// 2^31 for S <= 16384.
constexpr int kMaxStages = 16384;

// Every stage but the last on rank 0: the one boundary that crosses ranks is
// the last, whose messages carry the largest tags.
std::vector<int> all_but_last_on_rank0(int stages, int ranks) {
  std::vector<int> map(static_cast<size_t>(stages), 0);
  if (ranks > 1) map.back() = 1;
  return map;
}

// One more stage than the tags allow is refused on every rank, pipelines
// of one rank included (the limit does not depend on the placement).
TEST(StageCount, BeyondTheTagRangeIsRefused) {
  EXPECT_EQ(PipelineRuntime::kMaxStages, kMaxStages);
  const int stages = kMaxStages + 1;
  for (int ranks : {1, 2}) {
    auto errors = errors_on_every_rank(ranks, [&](std::shared_ptr<Communicator> comm) {
      auto s = gpipe_on(all_but_last_on_rank0(stages, ranks), ranks, 1);
      std::vector<ScaleStage> params(static_cast<size_t>(stages));
      PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                         scale_stages(s, comm->rank(), params), s, mean_product);
    });
    for (int r = 0; r < ranks; ++r) {
      const auto& e = errors[static_cast<size_t>(r)];
      EXPECT_TRUE(has(e, "rank " + std::to_string(r) + " of group")) << e;
      EXPECT_TRUE(has(e, "16385 stages, more than the 16384 whose message tags fit")) << e;
    }
  }
}

// At the limit the last boundary's messages (the largest tags) arrive where
// they belong: with every p = 1 the output is x, so the loss is
// mean(x * t) and each p's gradient is that same mean.
TEST(StageCount, TheLargestStageCountRuns) {
  const int stages = kMaxStages, m = 2;
  const auto x = torch::arange(1.0, 5.0).reshape({4, 1}), t = torch::full({4, 1}, 0.5);
  const double expected = (x * t).mean().item<double>();  // 1.25
  auto errors = errors_on_every_rank(2, [&](std::shared_ptr<Communicator> comm) {
    auto s = gpipe_on(all_but_last_on_rank0(stages, 2), 2, m);
    std::vector<ScaleStage> params(static_cast<size_t>(stages));
    const int r = comm->rank();
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), scale_stages(s, r, params), s,
                       mean_product);
    auto result = rt.step({x}, {t});
    EXPECT_DOUBLE_EQ(result.loss, expected);
    for (int st : s.stages_of(r)) {
      const auto& g = params[static_cast<size_t>(st)].p.grad();
      ASSERT_TRUE(g.defined()) << "stage " << st;
      ASSERT_DOUBLE_EQ(g.item<double>(), expected) << "stage " << st;
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(2, kNoError));
}

}  // namespace
}  // namespace cohort::pipeline::runtime_errors_test
