#include "cohort/train/progress.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace cohort {
namespace {

std::string format_duration(double seconds) {
  const long s = static_cast<long>(seconds + 0.5);
  char text[32];
  if (s >= 3600) {
    std::snprintf(text, sizeof(text), "%ldh%02ldm", s / 3600, (s / 60) % 60);
  } else {
    std::snprintf(text, sizeof(text), "%ldm%02lds", s / 60, s % 60);
  }
  return text;
}

// A bar needs a terminal that honours '\r'. cohortrun under mpirun cuts the
// ranks' output into prefixed lines although Open MPI gives them a
// pseudo-terminal, so it asks for log lines with COHORT_PROGRESS=lines.
bool draw_bar() {
  const char* mode = std::getenv("COHORT_PROGRESS");
  if (mode != nullptr && std::string(mode) == "lines") return false;
  return ::isatty(STDOUT_FILENO) == 1;
}

}  // namespace

Progress::Progress(bool enabled, int64_t first_step, int64_t total_steps, int64_t log_every)
    : enabled_(enabled),
      tty_(draw_bar()),
      first_step_(first_step),
      total_steps_(total_steps),
      log_every_(log_every > 0 ? log_every : 1),
      start_(std::chrono::steady_clock::now()) {}

void Progress::update(const StepMetrics& m) {
  if (!enabled_) return;
  const double elapsed =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const int64_t done = m.step - first_step_;
  const int64_t left = total_steps_ - m.step;
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(left) : 0;
  if (tty_) {
    constexpr int kWidth = 30;
    const double frac = total_steps_ > 0 ? static_cast<double>(m.step) / total_steps_ : 1.0;
    const int filled = static_cast<int>(frac * kWidth);
    std::string bar(static_cast<size_t>(filled), '=');
    if (filled < kWidth) bar += '>';
    bar.resize(kWidth, ' ');
    std::printf("\r[%s] %lld/%lld loss %.4f lr %.2e %.0f samples/s ETA %s   ", bar.c_str(),
                static_cast<long long>(m.step), static_cast<long long>(total_steps_), m.loss, m.lr,
                m.samples_per_s, format_duration(eta).c_str());
    std::fflush(stdout);
    bar_open_ = true;
    return;
  }
  if (m.step % log_every_ != 0 && m.step != total_steps_) return;
  // Epochs are counted from 1 wherever a person reads them (as in the
  // examples' epoch summaries); m.epoch stays the 0-based index.
  // "comm" is the gradients' communication; tensor parallelism's, inside
  // forward and backward, is shown beside it where there is a TP dimension.
  char tp[48] = "";
  if (m.tp_comm_seconds) std::snprintf(tp, sizeof(tp), " tp comm %.3f s", *m.tp_comm_seconds);
  std::printf(
      "step %lld/%lld epoch %lld loss %.4f lr %.3e grad_norm %.3f %.0f samples/s comm %.3f s%s "
      "ETA %s\n",
      static_cast<long long>(m.step), static_cast<long long>(total_steps_),
      static_cast<long long>(m.epoch + 1), m.loss, m.lr, m.grad_norm, m.samples_per_s,
      m.comm_seconds, tp, format_duration(eta).c_str());
  std::fflush(stdout);
}

void Progress::finish() {
  if (bar_open_) {
    std::printf("\n");
    std::fflush(stdout);
    bar_open_ = false;
  }
}

}  // namespace cohort
