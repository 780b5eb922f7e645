// cohort-plot's library: reads what the trainer writes, refuses empty or
// corrupt files with the file (and line) named, draws a PNG with gnuplot.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <utility>

#include "cohort/train/metrics_log.h"
#include "plot_metrics.h"
#include "train_fixtures.h"

namespace plot_test {
namespace {

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const cohort_plot::PlotError& e) {
    return e.what();
  }
  return "(no PlotError)";
}

TEST(CohortPlot, ReadsTrainerMetricsAndDrawsAPng) {
  cohort::testing::TempDir dir("cohort-plot");
  const std::string path = dir / "m.jsonl";
  {
    cohort::MetricsLog log(path, true);
    for (int64_t s = 1; s <= 20; ++s) {
      cohort::StepMetrics m;
      m.step = s;
      m.loss = 2.0 / static_cast<double>(s);
      log.append(cohort::to_json(m));
    }
    log.append({{"kind", "eval"}, {"step", 20}, {"test_accuracy", 0.75}});
  }
  const auto curves = cohort_plot::read_metrics(path);
  ASSERT_EQ(curves.loss.size(), 20u);
  EXPECT_DOUBLE_EQ(curves.loss[3].second, 0.5);
  ASSERT_EQ(curves.accuracy.size(), 1u);
  EXPECT_EQ(curves.accuracy_key, "test_accuracy");

  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  cohort_plot::plot_metrics(curves, dir / "c.png");
  std::ifstream png(dir / "c.png", std::ios::binary);
  char magic[8] = {};
  png.read(magic, 8);
  EXPECT_EQ(std::string(magic + 1, 3), "PNG");

  const auto missing = error_of([&] {
    cohort_plot::PlotOptions o;
    o.gnuplot = "cohort-no-such-gnuplot";
    cohort_plot::plot_metrics(curves, dir / "d.png", o);
  });
  EXPECT_NE(missing.find("gnuplot-nox"), std::string::npos) << missing;
}

// A job stopped after one step, or evaluated once, has curves of a single
// point; gnuplot then warns of an empty x or y range on the job's stderr
// unless the script gives the ranges. The stand-in gnuplot keeps the real
// one's stderr for the drawing script.
TEST(CohortPlot, SinglePointCurvesDrawWithoutGnuplotWarnings) {
  if (std::system("command -v gnuplot > /dev/null 2>&1") != 0) GTEST_SKIP() << "no gnuplot";
  cohort::testing::TempDir dir("cohort-plot-one");
  const std::string err = dir / "gnuplot.err", wrapper = dir / "gnuplot";
  std::ofstream(wrapper) << "#!/bin/sh\ncase \"$1\" in *.gp) exec gnuplot \"$@\" 2>>'" << err
                         << "' ;; esac\nexec gnuplot \"$@\"\n";
  std::filesystem::permissions(wrapper, std::filesystem::perms::owner_all);
  cohort_plot::PlotOptions options;
  options.gnuplot = wrapper;
  for (const auto& [loss, accuracy] :
       {std::pair{1.5, 0.782}, std::pair{0.0, 0.0}, std::pair{2.0, 1.0}}) {
    std::filesystem::remove(err);
    cohort_plot::Curves curves;
    curves.loss = {{30, loss}};
    curves.accuracy = {{30, accuracy}};
    curves.accuracy_key = "test_accuracy";
    cohort_plot::plot_metrics(curves, dir / "one.png", options);
    ASSERT_TRUE(std::filesystem::exists(err));
    std::ifstream in(err);
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(text, "") << "loss " << loss << ", accuracy " << accuracy;
  }
}

TEST(CohortPlot, EmptyOrCorruptFilesAreNamed) {
  cohort::testing::TempDir dir("cohort-plot-bad");
  const std::string empty = dir / "empty.jsonl", bad = dir / "bad.jsonl";
  std::ofstream(empty).close();
  std::ofstream(bad) << "{\"kind\": \"train\", \"step\": 1, \"loss\": 1.0}\n{\"kind\": \"tra";
  auto msg = error_of([&] { cohort_plot::read_metrics(empty); });
  EXPECT_NE(msg.find(empty + " is empty"), std::string::npos) << msg;
  msg = error_of([&] { cohort_plot::read_metrics(bad); });
  EXPECT_NE(msg.find(bad + " line 2"), std::string::npos) << msg;
  msg = error_of([&] { cohort_plot::read_metrics(dir / "none.jsonl"); });
  EXPECT_NE(msg.find("cannot open"), std::string::npos) << msg;
}

}  // namespace
}  // namespace plot_test
