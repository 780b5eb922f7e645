#include "cohort/train/metrics_log.h"

#include <vector>

#include "cohort/core/error.h"

namespace cohort {

nlohmann::json to_json(const StepMetrics& m) {
  return {{"kind", "train"},
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
}

MetricsLog::MetricsLog(std::string path, bool enabled)
    : path_(std::move(path)), enabled_(enabled && !path_.empty()) {}

void MetricsLog::keep_until(int64_t step) {
  if (!enabled_) return;
  out_.close();
  std::vector<std::string> kept;
  if (step >= 0) {
    std::ifstream in(path_);
    std::string line;
    while (std::getline(in, line)) {
      // A line cut short by a crash does not parse: drop it.
      auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<int64_t>() <= step) {
        kept.push_back(line);
      }
    }
  }
  std::ofstream rewrite(path_, std::ios::trunc);
  if (!rewrite) throw Error("metrics file " + path_ + ": cannot open for writing");
  for (const auto& line : kept) rewrite << line << '\n';
}

void MetricsLog::append(const nlohmann::json& line) {
  if (!enabled_) return;
  if (!out_.is_open()) {
    out_.open(path_, std::ios::app);
    if (!out_) throw Error("metrics file " + path_ + ": cannot open for appending");
  }
  out_ << line.dump() << '\n';
  out_.flush();
}

}  // namespace cohort
