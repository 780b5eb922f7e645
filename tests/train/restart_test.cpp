// Kill-and-restart end to end, as processes: cohortrun starts restart_job
// on 2 ranks; rank 1 SIGKILLs itself after step 25 (after the checkpoint
// at step 20); cohortrun --max-restarts 1 restarts the job, which resumes
// at step 20 and must end with the same final loss as an uninterrupted run.
#include <gtest/gtest.h>

#include <map>
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

// Every "<prefix><n>: <value>" line of `output`, by n.
std::map<int, std::string> lines_of(const std::string& output, const std::string& prefix) {
  std::map<int, std::string> out;
  const std::regex re(prefix + "([0-9]+)(?: loss)?: ([-0-9a-fA-F.e+]+)");
  for (auto it = std::sregex_iterator(output.begin(), output.end(), re);
       it != std::sregex_iterator(); ++it) {
    out[std::stoi((*it)[1].str())] = (*it)[2].str();
  }
  return out;
}

struct NoisyCase {
  int world;
  bool pipeline;  // a pipeline of one stage per rank, else DDP
};

class NoisyResume : public ::testing::TestWithParam<NoisyCase> {};

// Each rank augments its inputs from its process's default generator; fit()
// reads micro-batch 0 outside the training order (to count the global batch
// on resume, to check that a pipeline's stages drew the same samples),
// which must not shift those draws: stopped at step 5 and resumed, the job
// has the uninterrupted one's losses and parameters, bit for bit.
TEST_P(NoisyResume, HasTheUninterruptedRunsLossesAndParameters) {
  const auto c = GetParam();
  cohort::testing::TempDir whole("cohort-noisy-whole"), split("cohort-noisy-split");
  std::vector<std::string> args = {"-n", std::to_string(c.world), "--", RESTART_JOB_PATH,
                                   "--noisy"};
  if (c.pipeline) args.push_back("--pipeline");
  auto job = [&](const std::string& dir, int steps) {
    auto a = args;
    for (const std::string& s :
         {std::string("--dir"), dir, std::string("--max-steps"), std::to_string(steps)}) {
      a.push_back(s);
    }
    return run(a);
  };
  const JobRun a = job(whole.str(), 12);
  ASSERT_EQ(a.status, 0) << a.output;
  ASSERT_EQ(job(split.str(), 5).status, 0);
  const JobRun b = job(split.str(), 12);
  ASSERT_EQ(b.status, 0) << b.output;
  EXPECT_NE(b.output.find("resumed from step 5"), std::string::npos) << b.output;
  const auto uninterrupted = lines_of(a.output, "step "), resumed = lines_of(b.output, "step ");
  ASSERT_EQ(uninterrupted.size(), 12u) << a.output;
  ASSERT_EQ(resumed.size(), 7u) << b.output;
  for (const auto& [step, loss] : resumed) {
    EXPECT_EQ(loss, uninterrupted.at(step)) << "step " << step;
  }
  const auto params = lines_of(b.output, "params of rank ");
  EXPECT_EQ(params.size(), static_cast<size_t>(c.world)) << b.output;
  EXPECT_EQ(params, lines_of(a.output, "params of rank "));
}

INSTANTIATE_TEST_SUITE_P(KillAndRestart, NoisyResume,
                         ::testing::Values(NoisyCase{1, false}, NoisyCase{3, false},
                                           NoisyCase{1, true}, NoisyCase{2, true}),
                         [](const ::testing::TestParamInfo<NoisyCase>& i) {
                           return std::string(i.param.pipeline ? "pipeline_pp" : "ddp_world") +
                                  std::to_string(i.param.world);
                         });

}  // namespace
}  // namespace restart_test
