#include "cohort/optim/optimizer_state.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <typeinfo>

#include "cohort/core/error.h"

namespace cohort {
namespace {

void add(std::vector<std::pair<std::string, torch::Tensor>>& out, const char* name,
         const torch::Tensor& t) {
  if (t.defined()) out.emplace_back(name, t);
}

}  // namespace

std::vector<std::pair<std::string, torch::Tensor>> state_tensors(
    const torch::optim::OptimizerParamState& state) {
  using namespace torch::optim;
  std::vector<std::pair<std::string, torch::Tensor>> out;
  if (auto* s = dynamic_cast<const AdamWParamState*>(&state)) {
    add(out, "exp_avg", s->exp_avg());
    add(out, "exp_avg_sq", s->exp_avg_sq());
    add(out, "max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const AdamParamState*>(&state)) {
    add(out, "exp_avg", s->exp_avg());
    add(out, "exp_avg_sq", s->exp_avg_sq());
    add(out, "max_exp_avg_sq", s->max_exp_avg_sq());
  } else if (auto* s = dynamic_cast<const SGDParamState*>(&state)) {
    add(out, "momentum_buffer", s->momentum_buffer());
  } else if (auto* s = dynamic_cast<const RMSpropParamState*>(&state)) {
    add(out, "square_avg", s->square_avg());
    add(out, "momentum_buffer", s->momentum_buffer());
    add(out, "grad_avg", s->grad_avg());
  } else if (auto* s = dynamic_cast<const AdagradParamState*>(&state)) {
    add(out, "sum", s->sum());
  } else {
    throw Unsupported(std::string("optimizer state: unknown state class ") + typeid(state).name());
  }
  return out;
}

std::optional<int64_t> state_step(const torch::optim::OptimizerParamState& state) {
  using namespace torch::optim;
  if (auto* s = dynamic_cast<const AdamWParamState*>(&state)) return s->step();
  if (auto* s = dynamic_cast<const AdamParamState*>(&state)) return s->step();
  if (auto* s = dynamic_cast<const RMSpropParamState*>(&state)) return s->step();
  if (auto* s = dynamic_cast<const AdagradParamState*>(&state)) return s->step();
  return std::nullopt;
}

std::vector<std::string> state_names(const torch::optim::Optimizer& optimizer) {
  using namespace torch::optim;
  if (dynamic_cast<const AdamW*>(&optimizer) || dynamic_cast<const Adam*>(&optimizer)) {
    return {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"};
  }
  if (dynamic_cast<const SGD*>(&optimizer)) return {"momentum_buffer"};
  if (dynamic_cast<const RMSprop*>(&optimizer))
    return {"square_avg", "momentum_buffer", "grad_avg"};
  if (dynamic_cast<const Adagrad*>(&optimizer)) return {"sum"};
  throw Unsupported(std::string("optimizer state: unknown optimizer ") + typeid(optimizer).name());
}

int64_t optimizer_state_bytes(const torch::optim::Optimizer& optimizer) {
  int64_t bytes = 0;
  for (const auto& kv : optimizer.state()) {
    for (const auto& nt : state_tensors(*kv.second)) bytes += nt.second.nbytes();
  }
  return bytes;
}

}  // namespace cohort
