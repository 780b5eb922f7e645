#include "cohort/train/metrics_log.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <vector>

#include "cohort/core/error.h"

namespace cohort {

nlohmann::json to_json(const StepMetrics& m) {
  nlohmann::json line = {{"kind", "train"},
                         {"step", m.step},
                         {"epoch", m.epoch},
                         {"loss", m.loss},
                         {"lr", m.lr},
                         {"grad_norm", m.grad_norm},
                         {"clipped", m.clipped},
                         {"samples", m.samples},
                         {"step_seconds", m.step_seconds},
                         {"samples_per_s", m.samples_per_s},
                         {"comm_seconds", m.comm_seconds},
                         {"comm_bytes", m.comm_bytes}};
  for (const auto& [dim, bytes] : m.comm_bytes_by_dimension) line["comm_bytes_" + dim] = bytes;
  if (m.tp_comm_seconds) line["tp_comm_seconds"] = *m.tp_comm_seconds;
  return line;
}

MetricsLog::MetricsLog(std::string path, bool enabled, bool strict)
    : path_(std::move(path)), enabled_(enabled && !path_.empty()), strict_(strict) {}

MetricsLog::~MetricsLog() { close(); }

void MetricsLog::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

void MetricsLog::keep_until(int64_t step) {
  if (!enabled_) return;
  close();
  std::string kept;
  if (step >= 0) {
    std::ifstream in(path_);
    std::string line;
    while (std::getline(in, line)) {
      // A line cut short by a crash does not parse: drop it.
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<int64_t>() <= step) {
        kept += line + '\n';
      }
    }
  }
  // A read-only or missing folder is a configuration error, found at start.
  const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error("metrics file " + path_ + ": cannot open for writing: " + std::strerror(errno));
  }
  ::close(fd);
  if (!kept.empty()) write_whole(kept);
}

void MetricsLog::append(const nlohmann::json& line) {
  if (!enabled_) return;
  write_whole(line.dump() + '\n');
}

void MetricsLog::write_whole(const std::string& text) {
  if (fd_ < 0) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd_ < 0) {
      return failed(std::string("cannot open for appending: ") + std::strerror(errno));
    }
  }
  const off_t start = ::lseek(fd_, 0, SEEK_END);
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t k = ::write(fd_, text.data() + done, text.size() - done);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      const std::string why = k < 0 ? std::strerror(errno) : "no progress";
      // Cut the partial line back off (fails harmlessly on a device).
      if (done > 0 && start >= 0) (void)!::ftruncate(fd_, start);
      return failed("write failed: " + why);
    }
    done += static_cast<size_t>(k);
  }
}

void MetricsLog::failed(const std::string& what) {
  ++lines_lost_;
  const std::string message = "metrics file " + path_ + ": " + what;
  if (strict_) throw Error(message);
  if (warned_) return;
  warned_ = true;
  std::fprintf(stderr,
               "cohort: warning: %s; this and later metrics lines that fail are lost "
               "(training goes on)\n",
               message.c_str());
}

}  // namespace cohort
