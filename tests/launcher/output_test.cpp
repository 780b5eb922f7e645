// Output forwarding: every line prefixed with its rank, whole, on the
// stream it was written to.
#include <gtest/gtest.h>

#include <regex>
#include <set>

#include "support/subprocess.h"

namespace cohort::testing::output_test {
namespace {

TEST(Output, LinesStayWholeUnderConcurrentOutput) {
  constexpr int kRanks = 4;
  constexpr int kLines = 2000;
  // Each line is written in two pieces, so a launcher forwarding chunks as
  // they come instead of whole lines would split and mix them.
  const std::string script = "i=0; while [ $i -lt " + std::to_string(kLines) +
                             " ]; do printf 'rank %s ' $RANK; printf 'line %s\\n' $i; "
                             "i=$((i+1)); done";
  ProcessResult r = run_cohortrun({"-n", std::to_string(kRanks), "--", "sh", "-c", script});
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.exit_code, 0) << r.err;

  const std::regex line_re(R"(^\[(\d+)\] rank (\d+) line (\d+)$)");
  std::set<std::pair<int, int>> seen;
  int bad = 0;
  for (const std::string& line : lines_of(r.out)) {
    std::smatch m;
    if (!std::regex_match(line, m, line_re) || m[1] != m[2]) {
      if (++bad <= 5) ADD_FAILURE() << "malformed line: '" << line << "'";
      continue;
    }
    bool fresh = seen.emplace(std::stoi(m[1]), std::stoi(m[3])).second;
    EXPECT_TRUE(fresh) << "duplicate line: " << line;
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(seen.size(), static_cast<size_t>(kRanks * kLines));
  for (int rank = 0; rank < kRanks; ++rank) {
    EXPECT_TRUE(seen.count({rank, 0}) && seen.count({rank, kLines - 1}))
        << "rank " << rank << " incomplete";
  }
}

TEST(Output, StreamsKeptApartAndPartialLastLineFlushed) {
  ProcessResult r =
      run_cohortrun({"-n", "1", "--", "sh", "-c",
                     "printf 'to out\\n'; printf 'to err\\n' >&2; printf 'no newline'"});
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[0] to out\n[0] no newline\n");
  EXPECT_EQ(r.err, "[0] to err\n");
}

TEST(Output, QuietOthersShowsOnlyRankZero) {
  ProcessResult r = run_cohortrun(
      {"-n", "3", "--quiet-others", "--", "sh", "-c", "echo hello $RANK; echo warn $RANK >&2"});
  ASSERT_FALSE(r.timed_out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "[0] hello 0\n");
  EXPECT_EQ(r.err, "[0] warn 0\n");
}

TEST(Output, QuietRankFailureStillReportsItsLastLines) {
  const char* script = R"(
    if [ "$RANK" = 2 ]; then echo "secret of rank 2"; exit 4; fi
    exec sleep 60)";
  ProcessResult r = run_cohortrun({"-n", "3", "--quiet-others", "--", "sh", "-c", script});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 4) << r.err;
  EXPECT_EQ(r.out.find("secret"), std::string::npos) << r.out;
  EXPECT_NE(r.err.find("rank 2 exited with code 4"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[2] secret of rank 2"), std::string::npos) << r.err;
}

TEST(Output, FailureReportKeepsOnlyTheLastTenLines) {
  ProcessResult r = run_cohortrun({"-n", "1", "--", "sh", "-c",
                                   "i=0; while [ $i -lt 30 ]; do echo line $i; i=$((i+1)); done; "
                                   "exit 1"});
  ASSERT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_EQ(r.err.find("[0] line 19\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[0] line 20\n"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("[0] line 29\n"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace cohort::testing::output_test
