// GradientSynchronizer under gradient accumulation: M micro-batches, the
// first M - 1 inside no_sync() (the synchronizer's, or the DP reducer's
// NoSyncGuard), finish_backward() after every backward, as the header's
// recipe says. Each parameter's gradient is then the closed form of one
// reduction of the accumulated sum: a plain parameter's the mean over the
// dense group (dp x ep) of each rank's sum over its micro-batches; a
// sequence-parallel one's the sum of those means over the TP group; the
// tied embedding's (pp = 2) the sum over the first and the last stage; an
// expert's the sum over its replicas (dp) divided by the dense group's size.
// Ranks as threads over Gloo and UCX, world 1 to 6, M = 2 and 3. Each
// micro-batch's loss is sum(p * c) with c a per-rank, per-micro-batch,
// per-parameter constant, so each rank's local gradient is exactly c.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <optional>
#include <string>
#include <vector>

#include "cohort/mesh/gradient_synchronizer.h"
#include "support/thread_ranks.h"

namespace cohort::testing::gradient_accumulation_test {
namespace {

struct Case {
  std::string backend;
  int pp, dp, ep, tp;
  int micro_batches;
  bool reducer_guard;  // the DP reducer's NoSyncGuard instead of sync.no_sync()
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& c = info.param;
  return c.backend + "_pp" + std::to_string(c.pp) + "_dp" + std::to_string(c.dp) + "_ep" +
         std::to_string(c.ep) + "_tp" + std::to_string(c.tp) + "_m" +
         std::to_string(c.micro_batches) + (c.reducer_guard ? "_reducer_guard" : "");
}

void PrintTo(const Case& c, std::ostream* os) { *os << case_name({c, 0}); }

std::vector<std::string> backends() {
  std::vector<std::string> out = {"gloo"};
#ifdef COHORT_WITH_UCX
  out.push_back("ucx");
#endif
  return out;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const auto& b : backends()) {
    out.push_back({b, 1, 1, 1, 1, 2, false});  // world 1
    out.push_back({b, 1, 1, 1, 2, 2, false});  // tp 2, no DP reducer
    out.push_back({b, 1, 2, 1, 2, 2, false});  // tp 2 x dp 2
    out.push_back({b, 1, 2, 1, 2, 3, true});   // the DP reducer's own guard
    out.push_back({b, 1, 3, 1, 1, 2, true});   // world 3
    out.push_back({b, 2, 1, 1, 2, 2, false});  // the tied embedding, tp 2
    out.push_back({b, 2, 3, 1, 1, 2, false});  // pp 2 x dp 3
    out.push_back({b, 1, 2, 2, 1, 2, false});  // experts: dp 2 x ep 2
    out.push_back({b, 1, 1, 2, 2, 3, true});   // experts: ep 2 x tp 2
  }
  return out;
}

// The parameters, by role.
enum Role { kDense, kSequenceParallel, kEmbedding, kExpert, kRoles };

// Rank r's micro-batch m's local gradient of the parameter of `role`: small
// integers, so that every sum is exact.
double c_of(int r, int m, int role) { return 1 + r + 7 * m + 50 * role; }

// Coordinates of a rank in the mesh {pp, dp, ep, tp} (row-major).
struct Coord {
  int pp, dp, ep, tp;
};

Coord coord_of(const Case& k, int r) {
  return {r / (k.dp * k.ep * k.tp), r / (k.ep * k.tp) % k.dp, r / k.tp % k.ep, r % k.tp};
}

int rank_of(const Case& k, Coord c) { return ((c.pp * k.dp + c.dp) * k.ep + c.ep) * k.tp + c.tp; }

// Rank r's gradient of `role` summed over its micro-batches.
double local_sum(const Case& k, int r, int role) {
  double s = 0;
  for (int m = 0; m < k.micro_batches; ++m) s += c_of(r, m, role);
  return s;
}

// The mean over rank r's dense group (same pp and tp).
double dense_mean(const Case& k, int r, int role) {
  const auto c = coord_of(k, r);
  double s = 0;
  for (int d = 0; d < k.dp; ++d) {
    for (int e = 0; e < k.ep; ++e) s += local_sum(k, rank_of(k, {c.pp, d, e, c.tp}), role);
  }
  return s / (k.dp * k.ep);
}

double expected(const Case& k, int r, int role) {
  const auto c = coord_of(k, r);
  switch (role) {
    case kSequenceParallel: {
      double s = 0;
      for (int t = 0; t < k.tp; ++t) s += dense_mean(k, rank_of(k, {c.pp, c.dp, c.ep, t}), role);
      return s;
    }
    case kEmbedding: {
      if (k.pp == 1) return dense_mean(k, r, role);
      return dense_mean(k, rank_of(k, {0, c.dp, c.ep, c.tp}), role) +
             dense_mean(k, rank_of(k, {k.pp - 1, c.dp, c.ep, c.tp}), role);
    }
    case kExpert: {
      double s = 0;
      for (int d = 0; d < k.dp; ++d) s += local_sum(k, rank_of(k, {c.pp, d, c.ep, c.tp}), role);
      return s / (k.dp * k.ep);
    }
    default:
      return dense_mean(k, r, role);
  }
}

class GradientAccumulation : public ::testing::TestWithParam<Case> {};

TEST_P(GradientAccumulation, FinishBackwardAfterEachMicroBatchReducesTheSumOnce) {
  const auto k = GetParam();
  ThreadRanksOptions o;
  o.backend = k.backend;
  run_ranks_shared(
      k.pp * k.dp * k.ep * k.tp,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {k.pp, k.dp, k.ep, k.tp}, {"pp", "dp", "ep", "tp"});
        auto stage = std::make_shared<torch::nn::Module>("Stage");
        std::vector<torch::Tensor> params;
        for (int role = 0; role < kRoles; ++role) {
          params.push_back(stage->register_parameter("p" + std::to_string(role),
                                                     torch::zeros({3, 2}, torch::kFloat64)));
        }
        GradientSynchronizerOptions options;
        options.expert_parameters = {params[kExpert]};
        // Each rank's gradients are its own counts, not a model's: the dense
        // one differs across TP ranks on purpose.
        options.verify_tp_replicas = false;
        GradientSynchronizer sync(mesh, stage, {params[kSequenceParallel]}, params[kEmbedding],
                                  options);
        const int r = world->rank();
        for (int m = 0; m < k.micro_batches; ++m) {
          std::optional<GradientSynchronizer::NoSync> local;
          std::optional<NoSyncGuard> reducer_local;
          if (m + 1 < k.micro_batches) {
            if (k.reducer_guard && sync.dp_reducer()) {
              reducer_local.emplace(*sync.dp_reducer());
            } else {
              local.emplace(sync.no_sync());
            }
          }
          sync.prepare_forward();
          auto loss = torch::zeros({}, torch::kFloat64);
          for (int role = 0; role < kRoles; ++role)
            loss = loss + (params[role] * c_of(r, m, role)).sum();
          sync.after_forward({loss});
          loss.backward();
          sync.finish_backward();
        }
        const char* names[] = {"dense", "sequence-parallel", "embedding", "expert"};
        for (int role = 0; role < kRoles; ++role) {
          const double want = expected(k, r, role);
          const auto& g = params[role].grad();
          ASSERT_TRUE(g.defined()) << names[role];
          EXPECT_NEAR(g.min().item<double>(), want, 1e-9 * want)
              << "rank " << r << ": the " << names[role] << " parameter";
          EXPECT_NEAR(g.max().item<double>(), want, 1e-9 * want)
              << "rank " << r << ": the " << names[role] << " parameter";
        }
        EXPECT_EQ(sync.stats().steps, 1);
      },
      o);
}

INSTANTIATE_TEST_SUITE_P(Meshes, GradientAccumulation, ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::gradient_accumulation_test
