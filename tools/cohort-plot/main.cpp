// cohort-plot METRICS.jsonl -o curves.png: loss and accuracy curves of a
// cohort training run, drawn with gnuplot.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "plot_metrics.h"

int main(int argc, char** argv) {
  CLI::App app{"Draws the loss and accuracy curves of a cohort metrics file with gnuplot."};
  std::string metrics, output = "curves.png";
  cohort_plot::PlotOptions options;
  app.add_option("metrics", metrics, "metrics file (JSON lines written by cohort::Trainer)")
      ->required();
  app.add_option("-o,--output", output, "PNG file to write");
  app.add_option("--gnuplot", options.gnuplot, "gnuplot program to run");
  CLI11_PARSE(app, argc, argv);
  try {
    const auto curves = cohort_plot::read_metrics(metrics);
    cohort_plot::plot_metrics(curves, output, options);
    std::printf("cohort-plot: %zu loss points, %zu accuracy points -> %s\n", curves.loss.size(),
                curves.accuracy.size(), output.c_str());
    return 0;
  } catch (const cohort_plot::PlotError& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
