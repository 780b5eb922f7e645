#include "cohort/train/initial_lrs.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <sstream>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort {
namespace {

const std::string kGroupOptionPrefix = "optim.param_groups.";
const std::string kLrSuffix = ".lr";

// Sets the optimizer's rates to `lrs` and refreshes `state`'s copies of them.
void set_and_refresh(TrainerOptimizer& optimizer, dcp::StateDict& state,
                     const std::vector<double>& lrs) {
  optimizer.set_lrs(lrs);
  for (const auto& refresh : state.refresh) refresh();
}

// The optimizer's rates, put back when it goes (a refresh that throws
// leaves no group at its mark).
class RatesKept {
 public:
  RatesKept(TrainerOptimizer& optimizer, dcp::StateDict& state)
      : optimizer_(optimizer), state_(state), lrs_(optimizer.lrs()) {}
  ~RatesKept() {
    try {
      set_and_refresh(optimizer_, state_, lrs_);
    } catch (...) {
      optimizer_.set_lrs(lrs_);
    }
  }
  const std::vector<double>& lrs() const { return lrs_; }

 private:
  TrainerOptimizer& optimizer_;
  dcp::StateDict& state_;
  std::vector<double> lrs_;
};

std::string hex_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%a", v);
  return buf;
}

std::string listed(const std::vector<std::string>& names) {
  std::string out;
  for (size_t i = 0; i < names.size() && i < 3; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > 3) out += ", ... (" + std::to_string(names.size()) + " parameters)";
  return out;
}

}  // namespace

std::vector<std::vector<std::string>> group_parameter_names(TrainerOptimizer& optimizer,
                                                            dcp::StateDict& state) {
  RatesKept kept(optimizer, state);
  const size_t groups = kept.lrs().size();
  // Marks 1..G: exact in float64, and no group's own rate matters here.
  std::vector<double> marks;
  for (size_t g = 0; g < groups; ++g) marks.push_back(static_cast<double>(g + 1));
  set_and_refresh(optimizer, state, marks);
  std::vector<std::vector<std::string>> names(groups);
  for (const auto& e : state.tensors) {
    const auto& fqn = e.fqn;
    if (e.shards.empty() || fqn.size() <= kGroupOptionPrefix.size() + kLrSuffix.size() ||
        fqn.compare(0, kGroupOptionPrefix.size(), kGroupOptionPrefix) != 0 ||
        fqn.compare(fqn.size() - kLrSuffix.size(), kLrSuffix.size(), kLrSuffix) != 0) {
      continue;
    }
    const double mark = e.shards[0].data.item<double>();
    const auto g = static_cast<int64_t>(std::llround(mark)) - 1;
    if (g < 0 || g >= static_cast<int64_t>(groups) || mark != static_cast<double>(g + 1)) continue;
    names[static_cast<size_t>(g)].push_back(fqn.substr(
        kGroupOptionPrefix.size(), fqn.size() - kGroupOptionPrefix.size() - kLrSuffix.size()));
  }
  for (auto& n : names) std::sort(n.begin(), n.end());
  return names;
}

std::string encode_initial_lrs(const std::vector<std::vector<std::string>>& names,
                               const std::vector<double>& lrs) {
  std::string out;
  for (size_t g = 0; g < names.size() && g < lrs.size(); ++g) {
    if (names[g].empty()) continue;
    out += hex_double(lrs[g]);
    for (const auto& n : names[g]) out += "\t" + n;
    out += "\n";
  }
  return out;
}

std::vector<double> match_initial_lrs(const std::vector<std::string>& records,
                                      const std::vector<std::vector<std::string>>& names,
                                      const std::vector<double>& mine, const std::string& where) {
  // Every rank's groups: a parameter's rate as each rank that held it
  // recorded it (the replicas of a stage recorded it alike).
  std::map<std::string, std::set<double>> recorded;
  for (const auto& record : records) {
    std::istringstream lines(record);
    std::string line;
    while (std::getline(lines, line)) {
      std::istringstream fields(line);
      std::string field;
      if (!std::getline(fields, field, '\t')) continue;
      const double lr = std::strtod(field.c_str(), nullptr);
      while (std::getline(fields, field, '\t')) recorded[field].insert(lr);
    }
  }
  std::vector<double> out = mine;
  for (size_t g = 0; g < names.size(); ++g) {
    if (names[g].empty()) continue;
    std::map<double, std::vector<std::string>> by_rate;
    std::vector<std::string> missing;
    for (const auto& n : names[g]) {
      auto it = recorded.find(n);
      if (it == recorded.end()) {
        missing.push_back(n);
        continue;
      }
      for (const double lr : it->second) by_rate[lr].push_back(n);
    }
    const std::string group =
        where + "optimizer parameter group " + std::to_string(g) + " (" + listed(names[g]) + ")";
    if (!missing.empty()) {
      throw ConfigError(group +
                        ": the checkpoint recorded no learning-rate schedule's initial "
                        "rate for " +
                        listed(missing) +
                        "; resume with parameter groups over the parameters that wrote it");
    }
    if (by_rate.size() > 1) {
      std::string rates;
      for (const auto& [lr, held] : by_rate) {
        rates += (rates.empty() ? "" : "; ") + listed(held) + " at " + double_text(lr);
      }
      throw ConfigError(group +
                        " holds parameters whose groups had different initial rates in "
                        "the checkpoint (" +
                        rates + "); resume with the parameter groups that wrote it");
    }
    out[g] = by_rate.begin()->first;
  }
  return out;
}

}  // namespace cohort
