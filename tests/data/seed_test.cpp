// cohort::data::manual_seed: under SeedScope::Same every rank's LibTorch
// draws what one process seeded with the seed draws; under PerRank, rank r
// draws what one process seeded with rank_seed(seed, r) draws, and the
// ranks' draws (normal noise, dropout masks) differ. LibTorch's default
// generator is one per process, so the ranks are processes (seed_job under
// cohortrun), at worlds 1 and 3. The agreement check runs over threads.
#include "cohort/data/seed.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include "support/subprocess.h"
#include "support/thread_ranks.h"

namespace cohort::testing::seed_test {
namespace {

using data::SeedScope;

// The hex floats print() of seed_job wrote for `t`.
std::string hex(const torch::Tensor& t) {
  std::string out;
  for (int64_t i = 0; i < t.numel(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %a", static_cast<double>(t[i].item<float>()));
    out += buf;
  }
  return out;
}

// What one process draws after torch::manual_seed(seed): randn(4), then
// (for the per-rank line) a dropout mask of 16.
std::string one_process(uint64_t seed, bool with_mask) {
  torch::manual_seed(seed);
  auto line = hex(torch::randn({4}));
  if (with_mask) line += " mask" + hex(torch::dropout(torch::ones({16}), 0.5, true));
  return line;
}

class SeedScopes : public ::testing::TestWithParam<int> {};

TEST_P(SeedScopes, SameAgreesAndPerRankDiffersAcrossProcesses) {
  const int world = GetParam();
  const auto run = run_cohortrun({"-n", std::to_string(world), "--", SEED_JOB_PATH}, Seconds(60),
                                 {"OMP_NUM_THREADS=1", "OPENBLAS_NUM_THREADS=1"});
  ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
  std::map<int, std::string> same, per_rank;
  const std::regex line_re("rank (\\d+) (same|perrank)(.*)");
  std::istringstream lines(run.out);
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (!std::regex_search(line, m, line_re)) continue;
    (m[2] == "same" ? same : per_rank)[std::stoi(m[1])] = m[3];
  }
  ASSERT_EQ(static_cast<int>(same.size()), world) << run.out;
  ASSERT_EQ(static_cast<int>(per_rank.size()), world) << run.out;
  std::set<std::string> distinct;
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ(same[r], one_process(42, false)) << "rank " << r;
    EXPECT_EQ(per_rank[r], one_process(data::rank_seed(42, r), true)) << "rank " << r;
    distinct.insert(per_rank[r].substr(per_rank[r].find(" mask")));     // the masks alone
    distinct.insert(per_rank[r].substr(0, per_rank[r].find(" mask")));  // the noise alone
  }
  EXPECT_EQ(static_cast<int>(distinct.size()), 2 * world) << run.out;
}

INSTANTIATE_TEST_SUITE_P(Worlds, SeedScopes, ::testing::Values(1, 3));

TEST(SeedAgreement, RanksThatDifferAreNamedOnEveryRank) {
  std::vector<std::string> errors(3);
  run_ranks(3, [&](Communicator& comm) {
    const uint64_t seed = comm.rank() == 2 ? 43 : 42;
    try {
      data::manual_seed(seed, SeedScope::Same, comm);
    } catch (const InvalidArgument& e) {
      errors[comm.rank()] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("rank 2 (seed 43, Same)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank 0 (seed 42, Same)"), std::string::npos) << errors[r];
  }
}

TEST(SeedAgreement, ScopesThatDifferAreRefused) {
  std::vector<int> refused(3, 0);
  run_ranks(3, [&](Communicator& comm) {
    try {
      data::manual_seed(7, comm.rank() == 1 ? SeedScope::PerRank : SeedScope::Same, comm);
    } catch (const InvalidArgument&) {
      refused[comm.rank()] = 1;
    }
  });
  EXPECT_EQ(refused, std::vector<int>({1, 1, 1}));
}

TEST(RankSeed, DistinctPerRank) {
  std::set<uint64_t> seeds;
  for (int r = 0; r < 64; ++r) seeds.insert(data::rank_seed(42, r));
  EXPECT_EQ(seeds.size(), 64u);
}

}  // namespace
}  // namespace cohort::testing::seed_test
