// defines: read_metrics (a cohort metrics JSON-lines file) and
// plot_metrics (draws loss and accuracy curves to a PNG with gnuplot).
//
// Plain C++ and nlohmann-json, no LibTorch: the tool stays quick to build,
// and the fashion_mnist example links the same code to draw its curves.
#pragma once

#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cohort_plot {

// Anything that keeps the plot from being drawn; the message says what and
// names the file.
class PlotError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Curves {
  std::vector<std::pair<double, double>> loss;      // (step, train loss)
  std::vector<std::pair<double, double>> accuracy;  // (step, eval accuracy)
  std::string accuracy_key;                         // the eval field plotted
};

// Reads "train" lines' loss and "eval" lines' accuracy (test_accuracy, or
// the first field whose name contains "accuracy"). Throws PlotError when
// the file is missing, has no train line, or a line is not JSON (with its
// line number).
Curves read_metrics(const std::string& path);

struct PlotOptions {
  std::string gnuplot = "gnuplot";  // program to run (looked up on PATH)
  int width = 1100;                 // image size in pixels
  int height = 420;
  int timeout_s = 60;               // gnuplot is killed after this long
};

// Draws `curves` into `png_path`. Throws PlotError when gnuplot is missing,
// fails, or times out.
void plot_metrics(const Curves& curves, const std::string& png_path,
                  const PlotOptions& options = {});

}  // namespace cohort_plot
