// The pieces adaptive is built from: the piecewise cost, the model's choice and
// its text form, the tree shape, and adaptive end to end on threads.
#include "cohort/algorithms/cost_model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <map>

#include "cohort/algorithms/calibration.h"
#include "cohort/algorithms/double_binary_tree.h"
#include "cohort/comm/engine_registry.h"
#include "support/thread_ranks.h"
#include "tests/contract/contract_values.h"

namespace cohort::algorithms::cost_model_test {
namespace {

TEST(PiecewiseCost, IsTheLineThroughTheMeasuredEndsOfEachBand) {
  PiecewiseCost c({{4096, 30}, {1024, 20}, {65536, 100}});
  EXPECT_DOUBLE_EQ(c.at(1024), 20);
  EXPECT_DOUBLE_EQ(c.at(2560), 25);  // halfway from 1024 to 4096
  EXPECT_DOUBLE_EQ(c.at(4096 + 61440 / 4), 30 + 70.0 / 4);
  EXPECT_DOUBLE_EQ(c.at(100), 20);          // below: latency bound
  EXPECT_DOUBLE_EQ(c.at(131072), 200);      // above: scales with size
  EXPECT_THROW(PiecewiseCost({{1024, 1}, {1024, 2}}), InvalidArgument);
}

TEST(PiecewiseCost, ABiggerMessageIsNeverCheaper) {
  // The 4 KiB sample (noise) costs more than 16 KiB: the two are pooled at
  // their mean, which is still above 1 KiB's.
  PiecewiseCost c({{1024, 20}, {4096, 90}, {16384, 40}});
  EXPECT_DOUBLE_EQ(c.points()[0].second, 20);
  EXPECT_DOUBLE_EQ(c.points()[1].second, 65);
  EXPECT_DOUBLE_EQ(c.points()[2].second, 65);
  // A pool that falls below the point before it takes that point in too.
  PiecewiseCost d({{1024, 50}, {4096, 60}, {16384, 10}, {65536, 100}});
  EXPECT_DOUBLE_EQ(d.points()[0].second, 40);
  EXPECT_DOUBLE_EQ(d.points()[2].second, 40);
  EXPECT_DOUBLE_EQ(d.points()[3].second, 100);
  for (double n = 512; n < 40000; n *= 1.3) EXPECT_LE(c.at(n), c.at(n * 1.3)) << n;
}

TEST(CostModel, PicksTheCheapestAndRoundTripsAsText) {
  CostModel m;
  m.set(Algorithm::Engine, PiecewiseCost({{1e3, 20}, {1e6, 10010}}));
  m.set(Algorithm::Ring, PiecewiseCost({{1e3, 101}, {1e6, 1100}}));
  m.set(Algorithm::HalvingDoubling, PiecewiseCost({{1e3, 102}, {1e6, 1050}}));
  EXPECT_EQ(m.best(1000), Algorithm::Engine);
  EXPECT_EQ(m.best(1e6), Algorithm::HalvingDoubling);
  EXPECT_EQ(m.best(4e6), Algorithm::HalvingDoubling);  // extrapolated
  auto back = CostModel::parse(m.serialize());
  EXPECT_EQ(back.serialize(), m.serialize());
  EXPECT_EQ(back.best(1e6), Algorithm::HalvingDoubling);
  EXPECT_THROW(CostModel::parse("nonsense 1:2;"), Error);
  EXPECT_THROW(CostModel::parse("ring 1024;"), Error);
  EXPECT_THROW(CostModel::parse("ring 1024:x;"), Error);
  EXPECT_THROW(CostModel::parse("ring;"), Error);
}

TEST(CostModel, KeepsTheEngineUnlessAnotherIsClearlyFaster) {
  CostModel m;
  m.set(Algorithm::Engine, PiecewiseCost({{1e3, 100}, {1e6, 1000}}));
  m.set(Algorithm::Ring, PiecewiseCost({{1e3, 92}, {1e6, 800}}));
  EXPECT_EQ(m.best(1e3), Algorithm::Engine);  // 8% faster: within the margin
  EXPECT_EQ(m.best(1e6), Algorithm::Ring);    // 20% faster
}

TEST(Calibration, ALoopCostsTheMeanOfItsFastestNinetyPercent) {
  // 18 runs of 100 us and two 4 ms stalls: the slowest tenth (2 runs) is
  // left out, so chance stalls at a few percent do not decide a point...
  std::vector<double> runs(18, 100.0);
  runs.push_back(4000);
  runs.insert(runs.begin() + 3, 4000);
  EXPECT_DOUBLE_EQ(loop_cost(runs), 100);
  // ...but a stall rate that belongs to the algorithm counts: 6 of 20.
  std::vector<double> stalling(14, 100.0);
  for (int i = 0; i < 6; ++i) stalling.push_back(4000);
  EXPECT_DOUBLE_EQ(loop_cost(stalling), (14 * 100.0 + 4 * 4000.0) / 18);
  EXPECT_DOUBLE_EQ(loop_cost({7, 5, 9}), 7);  // under ten runs: the plain mean
  EXPECT_DOUBLE_EQ(loop_cost({}), 0);
}

TEST(Calibration, EachCandidateFollowsEachOtherEquallyOften) {
  for (size_t n : {2u, 5u, 6u}) {
    const int period = static_cast<int>(n % 2 == 0 ? n : 2 * n);
    std::map<std::pair<size_t, size_t>, int> follows;
    for (int round = 0; round < period; ++round) {
      std::vector<size_t> order;
      for (size_t j = 0; j < n; ++j) order.push_back(balanced_order(n, round, j));
      auto sorted = order;
      std::sort(sorted.begin(), sorted.end());
      for (size_t j = 0; j < n; ++j) ASSERT_EQ(sorted[j], j) << "not a permutation, n " << n;
      for (size_t j = 1; j < n; ++j) ++follows[{order[j - 1], order[j]}];
    }
    // Every ordered pair of different candidates, the same number of times.
    EXPECT_EQ(follows.size(), n * (n - 1)) << n;
    for (auto& [pair, count] : follows) EXPECT_EQ(count, period / static_cast<int>(n)) << n;
  }
}

TEST(AlgorithmNames, RoundTrip) {
  for (auto a : kFixedAlgorithms) EXPECT_EQ(parse_algorithm(to_string(a)), a);
  EXPECT_EQ(parse_algorithm("adaptive"), Algorithm::Adaptive);
  EXPECT_FALSE(parse_algorithm("fastest").has_value());
}

TEST(BinaryTree, EveryPositionReachesTheRootWithAtMostTwoChildren) {
  for (int p = 1; p <= 33; ++p) {
    int roots = 0;
    for (int pos = 0; pos < p; ++pos) {
      auto node = binary_tree_node(pos, p);
      EXPECT_LE(node.children.size(), 2u);
      for (int c : node.children) EXPECT_EQ(binary_tree_node(c, p).parent, pos) << p;
      if (node.parent < 0) ++roots;
      int hops = 0;
      for (int q = pos; q >= 0 && hops <= p; q = binary_tree_node(q, p).parent) ++hops;
      EXPECT_LE(hops, p) << "cycle at p " << p;
    }
    EXPECT_EQ(roots, 1) << p;
  }
}

// Adaptive calibrates once (every rank gets the same model through the
// store), picks a concrete algorithm per size, and computes right.
TEST(Adaptive, CalibratesOnceAndEveryRankAgrees) {
  std::vector<std::string> models(3);
  std::vector<std::vector<Algorithm>> picks(3);
  testing::ThreadRanksOptions o;
  o.algorithm = Algorithm::Adaptive;
  o.calibration_max_bytes = 1 << 20;  // the 4 MiB pick below is extrapolated
  testing::run_ranks(3, [&](Communicator& comm) {
    for (int64_t bytes : {int64_t{1} << 10, int64_t{1} << 16, int64_t{1} << 22}) {
      const auto a = comm.resolve_algorithm(Collective::AllReduce, bytes);
      EXPECT_NE(a, Algorithm::Adaptive);
      EXPECT_NE(a, Algorithm::Default);
      picks[comm.rank()].push_back(a);
    }
    models[comm.rank()] = comm.describe_cost_model(Collective::AllReduce);
    for (int64_t n : {int64_t{5}, int64_t{300001}}) {
      auto t = testing::rank_input(comm.rank(), n, torch::kFloat32);
      comm.all_reduce(t).wait();
      EXPECT_TRUE(testing::matches(t, testing::expected_reduction(ReduceOp::Sum, 3, n)));
    }
    auto in = testing::rank_input(comm.rank(), 6, torch::kFloat32);
    auto out = torch::empty({18});
    comm.all_gather_into_tensor(out, in).wait();
    EXPECT_TRUE(torch::equal(out.narrow(0, 6, 6), testing::rank_input(1, 6, torch::kFloat32)));
  }, o);
  EXPECT_EQ(picks[0], picks[1]);
  EXPECT_EQ(picks[0], picks[2]);
  // The models (the part before the samples) agree.
  auto lines = [](const std::string& s) { return s.substr(s.find("model"), s.find("samples") - s.find("model")); };
  EXPECT_EQ(lines(models[0]), lines(models[1]));
  EXPECT_EQ(lines(models[0]), lines(models[2]));
  EXPECT_NE(models[0].find("ring"), std::string::npos) << models[0];
}

// The other two calibrated operations: their warm-ups end on votes carried
// by the operation itself (the start of every rank's block), so a wrong
// vote would leave the ranks in different places and time out here.
TEST(Adaptive, ReduceScatterCalibrationAgreesAndComputesRight) {
  std::vector<std::string> models(2);
  testing::ThreadRanksOptions o;
  o.algorithm = Algorithm::Adaptive;
  o.calibration_max_bytes = 1 << 20;
  testing::run_ranks(2, [&](Communicator& comm) {
    models[comm.rank()] = comm.describe_cost_model(Collective::ReduceScatter);
    const int64_t each = 1001;
    auto in = testing::rank_input(comm.rank(), 2 * each, torch::kFloat32);
    auto out = torch::empty({each});
    comm.reduce_scatter_tensor(out, in).wait();
    auto expected = testing::expected_reduction(ReduceOp::Sum, 2, 2 * each);
    EXPECT_TRUE(testing::matches(out, expected.narrow(0, comm.rank() * each, each)));
  }, o);
  auto model = [](const std::string& s) { return s.substr(s.find("model"), s.find("samples") - s.find("model")); };
  EXPECT_EQ(model(models[0]), model(models[1]));
}

// The communicator's "engine" on an engine whose all-gather copies out of a
// buffer of its own (Gloo's, through c10d) means the ring from 4 MiB of
// output; on one that gathers into the outputs (UCX's), or when the
// operation names Engine, it stays the engine's. A gather across the
// threshold still holds every rank's closed-form part.
TEST(Algorithm, EngineChoiceOnGlooTakesTheRingForLargeAllGathers) {
  constexpr int64_t kThreshold = int64_t{4} << 20;
  for (const std::string backend : {"gloo", "ucx"}) {
    const auto built = available_backends();
    if (std::find(built.begin(), built.end(), backend) == built.end()) continue;
    testing::ThreadRanksOptions options;
    options.backend = backend;
    testing::run_ranks(
        3,
        [&](Communicator& comm) {
          const bool copies = backend == "gloo";
          const auto large = copies ? Algorithm::Ring : Algorithm::Engine;
          EXPECT_EQ(comm.resolve_algorithm(Collective::AllGather, kThreshold), large) << backend;
          EXPECT_EQ(comm.resolve_algorithm(Collective::AllGather, kThreshold - 1),
                    Algorithm::Engine)
              << backend;
          EXPECT_EQ(comm.resolve_algorithm(Collective::AllReduce, kThreshold), Algorithm::Engine);
          // Named by the operation, the engine's own.
          EXPECT_EQ(comm.resolve_algorithm(Collective::AllGather, kThreshold, Algorithm::Engine),
                    Algorithm::Engine);
          // One part a little above a third of the threshold: 3 parts cross it.
          const int64_t n = kThreshold / 4 / 3 + 1;
          auto part = torch::arange(n, torch::kFloat32) + 1000.0 * comm.rank();
          auto all = torch::empty({3 * n});
          comm.all_gather_into_tensor(all, part).wait();
          for (int r = 0; r < 3; ++r) {
            EXPECT_TRUE(torch::equal(all.narrow(0, r * n, n),
                                     torch::arange(n, torch::kFloat32) + 1000.0 * r))
                << backend << " rank " << r;
          }
        },
        options);
  }
  // One rank moves nothing: the engine, whatever the size.
  testing::run_ranks(1, [&](Communicator& comm) {
    EXPECT_EQ(comm.resolve_algorithm(Collective::AllGather, kThreshold), Algorithm::Engine);
  });
}

// init() reads the choice from the environment and refuses a bad one before
// any rendezvous; connect() reads no environment at all.
TEST(Algorithm, BadEnvironmentChoiceIsAConfigErrorOfInitOnly) {
  InitOptions io;
  io.rank = 0;
  io.world_size = 1;
  io.init_method = "file:///tmp/cohort-bad-env-" + std::to_string(getpid());
  auto init_fails_naming = [&](const char* variable) {
    try {
      init(io);
      finalize();
      ADD_FAILURE() << "init accepted a bad " << variable;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(variable), std::string::npos) << e.what();
    }
  };
  setenv("COHORT_ALGO", "fastest", 1);
  init_fails_naming("COHORT_ALGO");
  testing::run_ranks(1, [](Communicator& comm) {
    EXPECT_EQ(comm.resolve_algorithm(Collective::AllReduce, 1 << 20), Algorithm::Engine);
  });
  unsetenv("COHORT_ALGO");
  for (const char* bad : {"64MiB", "12", "-1"}) {
    setenv("COHORT_CALIBRATION_MAX_BYTES", bad, 1);
    init_fails_naming("COHORT_CALIBRATION_MAX_BYTES");
  }
  unsetenv("COHORT_CALIBRATION_MAX_BYTES");
}

}  // namespace
}  // namespace cohort::algorithms::cost_model_test
