// What one rank passes that its peers cannot see: a batch whose shape
// changes from step to step (trains, against one process), a batch that does
// not split, a schedule that differs from the other ranks' (an error on
// every rank, never a wait for the timeout), and complex tensors crossing a
// boundary (gradients reach every stage, on one rank or across ranks).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_test_models.h"
#include "support/rank_errors.h"
#include "support/tensor_checks.h"

namespace cohort::pipeline::step_inputs_test {
namespace {

using namespace cohort::pipeline::testing;
using cohort::testing::errors_on_every_rank;
using cohort::testing::expect_close;
using cohort::testing::kNoError;

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

std::string ranks_text(int first, int last) {
  std::string out = first == last ? "rank " : "ranks ";
  for (int r = first; r <= last; ++r) out += (r > first ? ", " : "") + std::to_string(r);
  return out;
}

using ScheduleCase = std::tuple<std::string, int>;  // make_schedule's name, pp

std::string case_name(const ::testing::TestParamInfo<ScheduleCase>& info) {
  return std::get<0>(info.param) + "_pp" + std::to_string(std::get<1>(info.param));
}

// Interleaved needs m to be a multiple of pp; 2 keeps the others short.
int microbatches(const std::string& schedule, int pp) { return schedule == "interleaved" ? pp : 2; }

class ShapeBetweenSteps : public ::testing::TestWithParam<ScheduleCase> {};

// Five steps of one runtime: a full batch, a short last batch, two
// sequence lengths (a padded length that varies per batch), then the first
// shape again (its boundary shapes known, no shape message). Each step's
// losses and gradients match one process on that batch. Before, the second
// step was refused on the rank sending across a boundary and its receivers
// waited for the timeout.
TEST_P(ShapeBetweenSteps, EachStepMatchesOneProcess) {
  const auto [name, pp] = GetParam();
  const int v = name == "interleaved" ? 2 : 1, stages = pp * v;
  const int m = microbatches(name, pp);
  const std::vector<std::vector<int64_t>> shapes{
      {2 * m, kWidth}, {m, kWidth}, {2 * m, 3, kWidth}, {2 * m, 5, kWidth}, {2 * m, kWidth}};
  std::vector<Reference> refs;
  for (size_t i = 0; i < shapes.size(); ++i)
    refs.push_back(reference_run(stages, det(shapes[i], 0.3 + i), det(shapes[i], 1.1 + i), m));
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto schedule = make_schedule(name, pp, v, m);
    auto model = make_mlp(stages);
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(r))
      mine.emplace_back(s, split_sequential(model, mlp_boundaries(stages), s));
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
    const auto params = model->parameters();
    for (size_t i = 0; i < shapes.size(); ++i) {
      model->zero_grad();
      auto result = rt.step({det(shapes[i], 0.3 + i)}, {det(shapes[i], 1.1 + i)});
      for (int mb = 0; mb < m; ++mb)
        EXPECT_NEAR(result.losses[mb], refs[i].losses[mb], 1e-5) << "step " << i << " mb " << mb;
      for (int s : schedule.stages_of(r))
        for (int k : {2 * s, 2 * s + 1})
          expect_close(params[k].grad(), refs[i].grads[k],
                       "step " + std::to_string(i) + " parameter " + std::to_string(k));
    }
  });
  EXPECT_EQ(errors, std::vector<std::string>(pp, kNoError));
}

INSTANTIATE_TEST_SUITE_P(Schedules, ShapeBetweenSteps,
                         ::testing::Combine(::testing::Values("gpipe", "1f1b", "zbh1",
                                                              "interleaved"),
                                            ::testing::Values(1, 2, 3)),
                         case_name);

// A batch that does not reach every micro-batch.
enum class BadBatch { NoInputs, UnevenTargets, Both };

const char* const kBadBatchNames[] = {"NoInputs", "UnevenTargets", "Both"};

void PrintTo(BadBatch bad, std::ostream* os) { *os << kBadBatchNames[static_cast<int>(bad)]; }

std::string bad_batch_name(const ::testing::TestParamInfo<std::tuple<BadBatch, int>>& info) {
  return kBadBatchNames[static_cast<int>(std::get<0>(info.param))] + std::string("_pp") +
         std::to_string(std::get<1>(info.param));
}

class BatchThatDoesNotSplit : public ::testing::TestWithParam<std::tuple<BadBatch, int>> {};

// The refusal names the rank that got the batch, on every rank, and the
// runtime runs the next (good) step. Before, only that rank threw and the
// others waited for its messages until the timeout.
TEST_P(BatchThatDoesNotSplit, IsAnErrorOnEveryRank) {
  const auto [bad, pp] = GetParam();
  const int m = 2, last = pp - 1;
  std::vector<std::string> refused(pp);
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = make_mlp(pp);
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                       {PipelineStage(r, split_sequential(model, mlp_boundaries(pp), r))},
                       Schedule1F1B(pp, m), mse);
    Tensors x{det({2 * m, kWidth}, 0.3)}, y{det({2 * m, kWidth}, 1.1)};
    if (bad == BadBatch::NoInputs) x.clear();
    if (bad == BadBatch::Both) x = {det({5, kWidth}, 0.3)};
    if (bad != BadBatch::NoInputs) y = {det({7, kWidth}, 1.1)};
    try {
      rt.step(x, y);
    } catch (const InvalidArgument& e) {
      refused[r] = e.what();
    }
    rt.step({det({2 * m, kWidth}, 0.3)}, {det({2 * m, kWidth}, 1.1)});
  });
  EXPECT_EQ(errors, std::vector<std::string>(pp, kNoError));
  std::string reason;
  if (bad == BadBatch::NoInputs) reason = "rank 0 (stage 0): no inputs";
  if (bad == BadBatch::Both) reason = "rank 0 (stage 0): a batch of 5 inputs does not split into 2";
  // One rank holding both ends reports its first problem.
  if (bad == BadBatch::UnevenTargets || (bad == BadBatch::Both && pp > 1))
    reason += std::string(reason.empty() ? "" : " micro-batches; ") + "rank " +
              std::to_string(last) + " (stage " + std::to_string(last) +
              "): a batch of 7 targets does not split into 2";
  for (int r = 0; r < pp; ++r) {
    const auto& e = refused[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "PipelineRuntime::step on rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e, reason)) << e << "\nexpected: " << reason;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, BatchThatDoesNotSplit,
                         ::testing::Combine(::testing::Values(BadBatch::NoInputs,
                                                              BadBatch::UnevenTargets,
                                                              BadBatch::Both),
                                            ::testing::Values(1, 2, 3)),
                         bad_batch_name);

class ScheduleDisagreement : public ::testing::TestWithParam<std::tuple<bool, int>> {};

// Same stages, micro-batches and stage-to-rank map, other action lists:
// rank 0 runs GPipe, rank 1 ZB-H1, rank 2 1F1B (or, with `same_name`, every
// rank 1F1B but rank 0's list is GPipe's). Before, construction passed and
// the step deadlocked (or, with 1F1B against ZB-H1, crossed messages).
TEST_P(ScheduleDisagreement, IsNamedAtConstruction) {
  const auto [same_name, pp] = GetParam();
  const int m = 2 * pp;
  auto schedule_of = [&](int r) {
    if (same_name) {
      auto s = r == 0 ? ScheduleGPipe(pp, m) : Schedule1F1B(pp, m);
      s.name = "1F1B";
      return s;
    }
    return r == 0 ? ScheduleGPipe(pp, m) : r == 1 ? ScheduleZBH1(pp, m) : Schedule1F1B(pp, m);
  };
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = make_mlp(pp);
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"),
                       {PipelineStage(r, split_sequential(model, mlp_boundaries(pp), r))},
                       schedule_of(r), mse);
    rt.step({det({2 * m, kWidth}, 0.3)}, {det({2 * m, kWidth}, 1.1)});
  });
  std::vector<std::string> groups;
  if (same_name)
    groups = {"(rank 0: 1F1B (actions digest ", "; " + ranks_text(1, pp - 1) + ": 1F1B (actions"};
  else
    groups = {"(rank 0: GPipe (actions digest ", "; rank 1: ZBH1 (actions digest "};
  if (!same_name && pp == 3) groups.push_back("; rank 2: 1F1B (actions digest ");
  for (int r = 0; r < pp; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_TRUE(has(e, "PipelineRuntime on rank " + std::to_string(r) + " of group")) << e;
    EXPECT_TRUE(has(e, "ranks disagree on the schedule")) << e;
    for (const auto& g : groups) EXPECT_TRUE(has(e, g)) << e << "\nexpected: " << g;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, ScheduleDisagreement,
                         ::testing::Combine(::testing::Bool(), ::testing::Values(2, 3)),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "SameName" : "Named") +
                                  "_pp" + std::to_string(std::get<1>(info.param));
                         });

// Three stages with complex boundaries: z = x A^T + i x B^T, then
// w = z C^T, then |w|^2 D^T (real) into the loss.
Tensors complex_stage(int s, const Tensors& p, const Tensors& in) {
  if (s == 0) return {torch::complex(in[0].matmul(p[0].t()), in[0].matmul(p[1].t()))};
  if (s == 1) return {in[0].matmul(p[0].t().to(torch::kComplexFloat))};
  return {torch::real(in[0] * torch::conj(in[0])).matmul(p[0].t())};
}

class ComplexBoundary : public ::testing::TestWithParam<ScheduleCase> {};

// Every parameter's gradient matches one process. Before, on one rank the
// earlier stages got no gradient (the complex input was neither detached nor
// given a gradient), and across ranks the send was refused on one rank.
TEST_P(ComplexBoundary, GradientsMatchOneProcess) {
  const auto [name, pp] = GetParam();
  const int m = 3, stages = 3;
  const auto x = det({2 * m, kWidth}, 0.3), y = det({2 * m, kWidth}, 1.1);
  const std::vector<Tensors> init{{det({kWidth, kWidth}, 1), det({kWidth, kWidth}, 2)},
                                  {det({kWidth, kWidth}, 3)},
                                  {det({kWidth, kWidth}, 4)}};
  auto fresh = [&](int s) {
    Tensors p;
    for (const auto& t : init[s]) p.push_back(t.clone().requires_grad_());
    return p;
  };
  std::vector<Tensors> ref_params;
  Tensors act{x};
  for (int s = 0; s < stages; ++s) {
    ref_params.push_back(fresh(s));
    act = complex_stage(s, ref_params[s], act);
  }
  mse(act, {y}).backward();
  auto errors = errors_on_every_rank(pp, [&](std::shared_ptr<Communicator> comm) {
    auto schedule = make_schedule(name, pp, stages / pp, m);
    std::vector<PipelineStage> mine;
    std::vector<std::pair<int, Tensors>> held;
    for (int s : schedule.stages_of(comm->rank())) {
      Tensors p = fresh(s);
      held.emplace_back(s, p);
      mine.emplace_back(
          s, [s, p](const Tensors& in) { return complex_stage(s, p, in); }, p);
    }
    PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
    rt.step({x}, {y});
    for (const auto& [s, p] : held)
      for (size_t k = 0; k < p.size(); ++k)
        expect_close(p[k].grad(), ref_params[s][k].grad(),
                     "stage " + std::to_string(s) + " parameter " + std::to_string(k));
  });
  EXPECT_EQ(errors, std::vector<std::string>(pp, kNoError));
}

INSTANTIATE_TEST_SUITE_P(Schedules, ComplexBoundary,
                         ::testing::Values(ScheduleCase{"interleaved", 1}, ScheduleCase{"gpipe", 3},
                                           ScheduleCase{"1f1b", 3}, ScheduleCase{"zbh1", 3}),
                         case_name);

}  // namespace
}  // namespace cohort::pipeline::step_inputs_test
