// Kill-and-restart end to end, as processes: cohortrun starts restart_job
// on 2 ranks; rank 1 SIGKILLs itself after step 25 (after the checkpoint
// at step 20); cohortrun --max-restarts 1 restarts the job, which resumes
// at step 20 and must end with the same final loss as an uninterrupted run.
#include <gtest/gtest.h>

#include <regex>
#include <string>

#include "train_fixtures.h"

namespace restart_test {
namespace {

struct JobRun {
  int status = -1;
  std::string output;
};

// Bounded: a hang fails the test after 100 s, never stalls it.
JobRun run(const std::vector<std::string>& cohortrun_args) {
  auto r = cohort::testing::run_cohortrun(cohortrun_args, cohort::testing::Seconds(100));
  return {r.timed_out ? 124 : r.exit_code, r.out + r.err};
}

std::string final_loss(const std::string& output) {
  std::smatch m;
  static const std::regex re("final loss: ([-0-9.e+]+)");
  return std::regex_search(output, m, re) ? m[1].str() : "(none)";
}

TEST(KillAndRestart, ResumesFromTheLastCheckpointWithTheSameFinalLoss) {
  cohort::testing::TempDir plain("cohort-restart-plain"), killed("cohort-restart-killed");
  const std::string job = RESTART_JOB_PATH;

  const JobRun a = run({"-n", "2", "--", job, "--dir", plain.str()});
  ASSERT_EQ(a.status, 0) << a.output;
  EXPECT_EQ(a.output.find("resumed from"), std::string::npos) << a.output;

  const JobRun b =
      run({"-n", "2", "--max-restarts", "1", "--", job, "--dir", killed.str(), "--kill-at", "25"});
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from step 20"), std::string::npos) << b.output;
  EXPECT_NE(final_loss(a.output), "(none)") << a.output;
  EXPECT_EQ(final_loss(b.output), final_loss(a.output)) << b.output;
}

}  // namespace
}  // namespace restart_test
