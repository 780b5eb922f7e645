// An elastic job end to end, as processes: cohortrun -n 3:4 starts
// elastic_job on 4 ranks; rank 3 dies at step 30 on every attempt. After
// its one restart at world 4 (--max-restarts 1) the job goes on at world 3
// from the step-25 checkpoint and finishes. Its final parameters must equal
// a reference run's: 4 ranks to step 25, then 3 ranks resumed.
#include <gtest/gtest.h>
#include <torch/serialize.h>

#include "train_fixtures.h"

namespace elastic_test {
namespace {

using cohort::testing::TempDir;

struct JobRun {
  int status = -1;
  std::string output;
};

// Bounded: a hang fails the test after 100 s, never stalls it.
JobRun run(const std::vector<std::string>& cohortrun_args) {
  auto r = cohort::testing::run_cohortrun(cohortrun_args, cohort::testing::Seconds(100));
  return {r.timed_out ? 124 : r.exit_code, r.out + r.err};
}

std::vector<torch::Tensor> load_params(const std::string& path) {
  std::vector<torch::Tensor> params;
  torch::load(params, path);
  return params;
}

TEST(ElasticRun, GoesOnAtThreeRanksFromTheLastCheckpointAndMatchesTheReference) {
  TempDir elastic("cohort-elastic-run"), reference("cohort-elastic-ref");
  const std::string job = ELASTIC_JOB_PATH;

  const JobRun a = run({"-n", "3:4", "--max-restarts", "1", "--", job, "--dir", elastic.str(),
                        "--fail-rank", "3", "--fail-at", "30", "--out", elastic / "final.pt"});
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_NE(a.output.find("cohortrun: restart 1/1 after rank 3 killed by signal 9"),
            std::string::npos)
      << a.output;
  EXPECT_NE(a.output.find("cohortrun: rank 3 failed 2 times"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("restarting at world 3 (min 3) from the newest checkpoint"),
            std::string::npos)
      << a.output;
  // (The world-4 restart's own "resumed" line may die unflushed with its rank.)
  EXPECT_NE(a.output.find("[0] resumed from step 25 at world 3"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("[0] final step 40"), std::string::npos) << a.output;

  const JobRun b1 = run({"-n", "4", "--", job, "--dir", reference.str(), "--max-steps", "25"});
  ASSERT_EQ(b1.status, 0) << b1.output;
  const JobRun b2 =
      run({"-n", "3", "--", job, "--dir", reference.str(), "--out", reference / "final.pt"});
  ASSERT_EQ(b2.status, 0) << b2.output;
  EXPECT_NE(b2.output.find("[0] resumed from step 25 at world 3"), std::string::npos) << b2.output;

  const auto got = load_params(elastic / "final.pt");
  const auto want = load_params(reference / "final.pt");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    const double rel = ((got[i] - want[i]).abs().max() / want[i].abs().max()).item<double>();
    EXPECT_LE(rel, 1e-5) << "parameter " << i;
  }
}

}  // namespace
}  // namespace elastic_test
