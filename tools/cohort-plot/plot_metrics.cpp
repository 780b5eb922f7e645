#include "plot_metrics.h"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

extern char** environ;

namespace cohort_plot {
namespace {

// Runs `argv` and waits at most timeout_s. Returns the exit code; throws
// PlotError when the program cannot be started or runs too long.
int run_program(const std::vector<std::string>& argv, int timeout_s, bool quiet) {
  std::vector<char*> args;
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  if (quiet) {
    posix_spawn_file_actions_addopen(&actions, STDOUT_FILENO, "/dev/null", O_WRONLY, 0);
    posix_spawn_file_actions_addopen(&actions, STDERR_FILENO, "/dev/null", O_WRONLY, 0);
  }
  pid_t pid = 0;
  const int rc = posix_spawnp(&pid, args[0], &actions, nullptr, args.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  if (rc == ENOENT) {
    throw PlotError("cohort-plot: " + argv[0] +
                    " not found on PATH; install the Debian package gnuplot-nox");
  }
  if (rc != 0) throw PlotError("cohort-plot: cannot start " + argv[0] + ": " + std::strerror(rc));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  int status = 0;
  while (true) {
    const pid_t done = ::waitpid(pid, &status, WNOHANG);
    if (done == pid) break;
    if (done < 0 && errno != EINTR) throw PlotError("cohort-plot: waitpid failed");
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      throw PlotError("cohort-plot: " + argv[0] + " did not finish within " +
                      std::to_string(timeout_s) + " s");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

void write_points(const std::string& path, const std::vector<std::pair<double, double>>& pts) {
  std::ofstream out(path);
  out.precision(17);  // the values ranges() compared, not rounded together
  for (const auto& [x, y] : pts) out << x << ' ' << y << '\n';
  if (!out) throw PlotError("cohort-plot: cannot write " + path);
}

// gnuplot string literal: single quotes, doubled inside.
std::string quoted(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("''") : std::string(1, c);
  return out + "'";
}

// gnuplot warns ("empty x range") when all points share an x or a y, as a
// one-point curve does: give such an axis a range around the value instead.
std::string ranges(const std::vector<std::pair<double, double>>& pts) {
  std::ostringstream out;
  out.precision(17);
  out << "set autoscale xy\n";
  if (pts.empty()) return out.str();
  auto [xmin, xmax] = std::minmax_element(pts.begin(), pts.end());
  auto [ymin, ymax] = std::minmax_element(
      pts.begin(), pts.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  auto around = [&](char axis, double v) {
    const double pad = v != 0 ? std::abs(v) * 0.05 : 1.0;
    out << "set " << axis << "range [" << v - pad << ':' << v + pad << "]\n";
  };
  if (xmin->first == xmax->first) around('x', xmin->first);
  if (ymin->second == ymax->second) around('y', ymin->second);
  return out.str();
}

}  // namespace

void plot_metrics(const Curves& curves, const std::string& png_path, const PlotOptions& options) {
  namespace fs = std::filesystem;
  // pngcairo draws smoother lines; the plain png terminal is the fallback
  // on builds without cairo.
  const bool cairo =
      run_program({options.gnuplot, "-e", "set terminal pngcairo"}, options.timeout_s, true) == 0;

  char tmpl[] = "/tmp/cohort-plot-XXXXXX";
  if (!::mkdtemp(tmpl)) throw PlotError("cohort-plot: cannot create a temporary folder");
  const fs::path tmp(tmpl);
  struct Cleanup {
    fs::path p;
    ~Cleanup() {
      std::error_code ec;
      fs::remove_all(p, ec);
    }
  } cleanup{tmp};

  const std::string loss_dat = (tmp / "loss.dat").string();
  const std::string acc_dat = (tmp / "accuracy.dat").string();
  write_points(loss_dat, curves.loss);
  write_points(acc_dat, curves.accuracy);
  const bool with_acc = !curves.accuracy.empty();

  std::ofstream script(tmp / "plot.gp");
  script << "set terminal " << (cairo ? "pngcairo" : "png") << " noenhanced size " << options.width
         << ',' << options.height << '\n'
         << "set output " << quoted(png_path) << '\n'
         << "set grid\nset key top right\n"
         << "set multiplot layout 1," << (with_acc ? 2 : 1) << '\n'
         << "set title 'training loss'\nset xlabel 'step'\nset ylabel 'loss'\n"
         << ranges(curves.loss) << "plot " << quoted(loss_dat)
         << " using 1:2 with lines lw 1 title 'loss (mean over ranks)'\n";
  if (with_acc) {
    script << "set title 'evaluation'\nset key bottom right\nset ylabel "
           << quoted(curves.accuracy_key) << '\n'
           << ranges(curves.accuracy) << "plot " << quoted(acc_dat)
           << " using 1:2 with linespoints pt 7 lw 2 title " << quoted(curves.accuracy_key) << '\n';
  }
  script << "unset multiplot\n";
  script.close();

  const int rc =
      run_program({options.gnuplot, (tmp / "plot.gp").string()}, options.timeout_s, false);
  if (rc != 0) {
    throw PlotError("cohort-plot: gnuplot failed (exit " + std::to_string(rc) + ") drawing " +
                    png_path);
  }
  if (!fs::exists(png_path) || fs::file_size(png_path) == 0) {
    throw PlotError("cohort-plot: gnuplot wrote no image to " + png_path);
  }
}

}  // namespace cohort_plot
