#include <fstream>

#include <nlohmann/json.hpp>

#include "plot_metrics.h"

namespace cohort_plot {

Curves read_metrics(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw PlotError("cohort-plot: cannot open metrics file " + path);
  Curves curves;
  std::string line;
  int number = 0;
  while (std::getline(in, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) {
      throw PlotError("cohort-plot: " + path + " line " + std::to_string(number) +
                      " is not a JSON object (corrupt or truncated metrics file)");
    }
    if (!j.contains("step") || !j["step"].is_number()) continue;
    const double step = j["step"].get<double>();
    const std::string kind = j.value("kind", "train");
    if (kind == "train" && j.contains("loss") && j["loss"].is_number()) {
      curves.loss.emplace_back(step, j["loss"].get<double>());
    } else if (kind == "eval") {
      if (curves.accuracy_key.empty()) {
        if (j.contains("test_accuracy")) {
          curves.accuracy_key = "test_accuracy";
        } else {
          for (auto it = j.begin(); it != j.end(); ++it) {
            if (it.key().find("accuracy") != std::string::npos) curves.accuracy_key = it.key();
          }
        }
      }
      if (!curves.accuracy_key.empty() && j.contains(curves.accuracy_key) &&
          j[curves.accuracy_key].is_number()) {
        curves.accuracy.emplace_back(step, j[curves.accuracy_key].get<double>());
      }
    }
  }
  if (curves.loss.empty()) {
    throw PlotError("cohort-plot: " + path +
                    (number == 0 ? " is empty" : " has no training loss lines"));
  }
  return curves;
}

}  // namespace cohort_plot
