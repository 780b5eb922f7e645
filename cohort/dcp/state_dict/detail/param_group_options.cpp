#include "cohort/dcp/state_dict/detail/param_group_options.h"

#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort::dcp::detail {
namespace {

using torch::optim::OptimizerOptions;

// One option of options class O: its name, how to read and write it.
template <class O>
struct Field {
  const char* name;
  double (*get)(const O&);
  void (*set)(O&, double);
};

// An option `name` of the options class O in scope, through its TORCH_ARG
// accessors (a number, or a flag as 0 or 1).
// clang-format off
#define COHORT_NUMBER(name) \
  Field<O>{#name, [](const O& o) { return o.name(); }, [](O& o, double v) { o.name(v); }}
#define COHORT_FLAG(name) \
  Field<O>{#name, [](const O& o) { return o.name() ? 1.0 : 0.0; }, \
           [](O& o, double v) { o.name(v != 0); }}
// clang-format on

// Adam's and AdamW's options, which have the same fields.
template <class O>
std::vector<Field<O>> adam_fields() {
  return {
      COHORT_NUMBER(lr),
      {"betas.0", [](const O& o) { return std::get<0>(o.betas()); },
       [](O& o, double v) { o.betas(std::make_tuple(v, std::get<1>(o.betas()))); }},
      {"betas.1", [](const O& o) { return std::get<1>(o.betas()); },
       [](O& o, double v) { o.betas(std::make_tuple(std::get<0>(o.betas()), v)); }},
      COHORT_NUMBER(eps),
      COHORT_NUMBER(weight_decay),
      COHORT_FLAG(amsgrad),
  };
}

std::vector<Field<torch::optim::SGDOptions>> sgd_fields() {
  using O = torch::optim::SGDOptions;
  return {COHORT_NUMBER(lr), COHORT_NUMBER(momentum), COHORT_NUMBER(dampening),
          COHORT_NUMBER(weight_decay), COHORT_FLAG(nesterov)};
}

std::vector<Field<torch::optim::RMSpropOptions>> rmsprop_fields() {
  using O = torch::optim::RMSpropOptions;
  return {COHORT_NUMBER(lr),           COHORT_NUMBER(alpha),    COHORT_NUMBER(eps),
          COHORT_NUMBER(weight_decay), COHORT_NUMBER(momentum), COHORT_FLAG(centered)};
}

std::vector<Field<torch::optim::AdagradOptions>> adagrad_fields() {
  using O = torch::optim::AdagradOptions;
  return {COHORT_NUMBER(lr), COHORT_NUMBER(lr_decay), COHORT_NUMBER(weight_decay),
          COHORT_NUMBER(initial_accumulator_value), COHORT_NUMBER(eps)};
}

#undef COHORT_NUMBER
#undef COHORT_FLAG

// Calls fn(options as its class, that class's fields) for the known
// classes; returns false for another class.
template <class Fn>
bool with_fields(OptimizerOptions& options, Fn&& fn) {
  using namespace torch::optim;
  if (auto* o = dynamic_cast<AdamWOptions*>(&options)) {
    fn(*o, adam_fields<AdamWOptions>());
  } else if (auto* o = dynamic_cast<AdamOptions*>(&options)) {
    fn(*o, adam_fields<AdamOptions>());
  } else if (auto* o = dynamic_cast<SGDOptions*>(&options)) {
    fn(*o, sgd_fields());
  } else if (auto* o = dynamic_cast<RMSpropOptions*>(&options)) {
    fn(*o, rmsprop_fields());
  } else if (auto* o = dynamic_cast<AdagradOptions*>(&options)) {
    fn(*o, adagrad_fields());
  } else {
    return false;
  }
  return true;
}

}  // namespace

std::vector<std::pair<std::string, double>> group_options(const OptimizerOptions& options) {
  std::vector<std::pair<std::string, double>> out;
  // Only read: with_fields hands out the options mutable for set_group_option.
  auto& mutable_options = const_cast<OptimizerOptions&>(options);
  const bool known = with_fields(mutable_options, [&](const auto& o, const auto& fields) {
    for (const auto& f : fields) out.emplace_back(f.name, f.get(o));
  });
  if (!known) {
    try {
      out.emplace_back("lr", options.get_lr());
    } catch (const c10::Error&) {
      // An options class that does not override get_lr: nothing to keep.
    }
  }
  return out;
}

void set_group_option(OptimizerOptions& options, const std::string& name, double value) {
  bool found = false;
  const bool known = with_fields(options, [&](auto& o, const auto& fields) {
    for (const auto& f : fields) {
      if (name == f.name) {
        f.set(o, value);
        found = true;
      }
    }
  });
  if (!known && name == "lr") {
    options.set_lr(value);
    found = true;
  }
  if (!found) throw InvalidArgument("dcp: this optimizer's groups have no option " + name);
}

void check_same_class(const OptimizerOptions& options, const Metadata& meta,
                      const std::string& fqn) {
  using namespace torch::optim;
  static const auto known = [] {
    std::set<std::string> names;
    for (const auto& fields : {group_options(AdamWOptions()), group_options(SGDOptions(0)),
                               group_options(RMSpropOptions()), group_options(AdagradOptions())}) {
      for (const auto& [name, value] : fields) names.insert(name);
    }
    return names;
  }();
  std::set<std::string> mine;
  for (const auto& [name, value] : group_options(options)) mine.insert(name);
  for (const auto& name : known) {
    if (mine.count(name) || !meta.find("optim.param_groups." + fqn + "." + name)) continue;
    throw ConfigError("dcp: the checkpoint holds the option " + name + " of " + fqn +
                      ", which this optimizer's parameter groups do not have: it was saved by "
                      "another optimizer class, whose options and state this one cannot take; "
                      "load it into an optimizer of that class (the optimizer is left as it was)");
  }
}

void check_one_value(const GroupTargets& targets,
                     const std::function<torch::Tensor(const torch::Tensor&)>& value,
                     const std::string& what) {
  for (const auto& [name, values] : targets) {
    const auto& [first_fqn, first_target] = values.front();
    const double first = value(first_target).item<double>();
    for (const auto& [fqn, target] : values) {
      const double v = value(target).item<double>();
      if (v == first || (std::isnan(v) && std::isnan(first))) continue;
      throw ConfigError("dcp: the loaded " + name + " is " + double_text(first) + " for " +
                        first_fqn + " and " + double_text(v) + " for " + fqn + ", which share " +
                        what +
                        "; load into an optimizer whose groups hold them apart (the "
                        "optimizer is left as it was)");
    }
  }
}

std::map<const void*, torch::optim::OptimizerParamGroup*> groups_by_param(
    torch::optim::Optimizer& optimizer) {
  std::map<const void*, torch::optim::OptimizerParamGroup*> out;
  for (auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out[p.unsafeGetTensorImpl()] = &group;
  }
  return out;
}

}  // namespace cohort::dcp::detail
