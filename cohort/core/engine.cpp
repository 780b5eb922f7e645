#include "cohort/core/engine.h"

#include "cohort/core/error.h"
#include "cohort/core/work_then.h"

namespace cohort {

void Engine::unsupported(const std::string& what) const {
  throw Unsupported("engine " + name() + " does not support " + what);
}

WorkPtr Engine::reduce_scatter(at::Tensor& output, std::vector<at::Tensor>& inputs, ReduceOp op) {
  std::vector<at::Tensor> flat_inputs;
  for (auto& t : inputs) flat_inputs.push_back(t.reshape({-1}));
  auto flat = at::cat(flat_inputs);
  auto work = all_reduce(flat, op);
  const int64_t n = output.numel();
  const int64_t offset = n * rank();
  return then(std::move(work), [output, flat, n, offset]() mutable {
    output.view({-1}).copy_(flat.narrow(0, offset, n));
  });
}

}  // namespace cohort
