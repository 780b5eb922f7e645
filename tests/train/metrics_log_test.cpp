#include "cohort/train/metrics_log.h"

#include <gtest/gtest.h>
#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>

#include "cohort/core/error.h"
#include "train_fixtures.h"

namespace cohort::metrics_log_test {
namespace {

std::vector<nlohmann::json> read_lines(const std::string& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

TEST(MetricsLog, AppendsJsonLinesAndRewindsOnResume) {
  testing::TempDir dir("cohort-metrics");
  const std::string path = dir / "m.jsonl";
  {
    MetricsLog log(path, true);
    for (int64_t s = 1; s <= 4; ++s) {
      StepMetrics m;
      m.step = s;
      m.loss = 1.0 / static_cast<double>(s);
      log.append(to_json(m));
    }
    log.append({{"kind", "eval"}, {"step", 4}, {"test_accuracy", 0.5}});
  }
  std::ofstream(path, std::ios::app) << "{\"kind\": \"train\", \"ste";  // a crash mid-line
  {
    MetricsLog log(path, true);
    log.keep_until(2);  // resumed from the step-2 checkpoint
    StepMetrics m;
    m.step = 3;
    log.append(to_json(m));
  }
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_EQ(lines[0]["step"], 1);
  EXPECT_DOUBLE_EQ(lines[1]["loss"].get<double>(), 0.5);
  EXPECT_EQ(lines[2]["step"], 3);
  for (const char* key :
       {"kind", "step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "comm_seconds"}) {
    EXPECT_TRUE(lines[2].contains(key)) << key;
  }
}

TEST(MetricsLog, DisabledOffRankZeroWritesNothing) {
  testing::TempDir dir("cohort-metrics-off");
  MetricsLog log(dir / "m.jsonl", false);
  log.keep_until(-1);
  log.append({{"kind", "train"}, {"step", 1}});
  EXPECT_FALSE(std::filesystem::exists(dir / "m.jsonl"));
}

// A full disk: one warning, training goes on; or an Error when strict.
TEST(MetricsLog, FullDiskWarnsOnceOrThrowsWhenStrict) {
  ASSERT_TRUE(std::filesystem::exists("/dev/full"));
  {
    MetricsLog log("/dev/full", true);
    ::testing::internal::CaptureStderr();
    log.append({{"kind", "train"}, {"step", 1}});
    log.append({{"kind", "train"}, {"step", 2}});
    const std::string err = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(log.lines_lost(), 2);
    EXPECT_NE(err.find("metrics file /dev/full: write failed: No space left on device"),
              std::string::npos)
        << err;
    EXPECT_EQ(err.find("warning"), err.rfind("warning")) << "warned more than once: " << err;
  }
  MetricsLog strict("/dev/full", true, /*strict=*/true);
  try {
    strict.append({{"kind", "train"}, {"step", 1}});
    ADD_FAILURE() << "a failed write passed silently";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/dev/full"), std::string::npos) << e.what();
  }
}

// A disk that fills in the middle of a line (a file size limit stands in
// for it): the partial line is cut back, so every line in the file parses.
TEST(MetricsLog, LineCutShortIsRemovedWhole) {
  testing::TempDir dir("cohort-metrics-full");
  const std::string path = dir / "m.jsonl";
  MetricsLog log(path, true);
  // A long first line: the limit below also applies to the file that
  // captures stderr, which must hold the warning.
  log.append({{"kind", "train"}, {"step", 1}, {"note", std::string(4000, 'n')}});
  const auto size = std::filesystem::file_size(path);
  rlimit old{};
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit tight = old;
  tight.rlim_cur = size + 10;  // room for 10 bytes of the next line
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &tight), 0);
  ::testing::internal::CaptureStderr();
  log.append({{"kind", "train"}, {"step", 2}, {"loss", 0.25}});
  const std::string err = ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_NE(err.find("File too large"), std::string::npos) << err;
  EXPECT_EQ(std::filesystem::file_size(path), size) << "half a line was left in the file";
  log.append({{"kind", "train"}, {"step", 3}});  // space again: lines resume
  const auto lines = read_lines(path);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(lines[1]["step"], 3);
  EXPECT_EQ(log.lines_lost(), 1);
}

}  // namespace
}  // namespace cohort::metrics_log_test
