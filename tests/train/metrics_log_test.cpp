#include <gtest/gtest.h>

#include <fstream>

#include "cohort/train/metrics_log.h"
#include "train_fixtures.h"

namespace cohort {
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
  for (const char* key : {"kind", "step", "epoch", "loss", "lr", "grad_norm", "samples_per_s",
                          "comm_seconds"}) {
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

}  // namespace
}  // namespace cohort
