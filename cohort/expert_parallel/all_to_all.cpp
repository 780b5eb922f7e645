// As in tensor_parallel's mappings, the communicator's address travels in the
// autograd context as an integer (an IValue map cannot hold it); the MoE
// module owns the communicator, so it outlives the graph. Tensors handed to
// the communicator are detached: out= kernels refuse inputs that require grad.
#include "cohort/expert_parallel/all_to_all.h"

#include <torch/autograd.h>

#include "cohort/core/once_differentiable.h"
namespace cohort::expert_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

torch::Tensor exchange(const torch::Tensor& rows, const std::vector<int64_t>& send,
                       const std::vector<int64_t>& recv, Communicator& group) {
  auto in = rows.detach().contiguous();
  int64_t total = 0;
  for (auto n : recv) total += n;
  auto sizes = in.sizes().vec();
  sizes[0] = total;
  auto out = torch::empty(sizes, in.options());
  group.all_to_all_single(out, in, recv, send).wait();
  return out;
}

struct AllToAllRows : torch::autograd::Function<AllToAllRows> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor rows, torch::Tensor anchor,
                               std::vector<int64_t> send, std::vector<int64_t> recv,
                               int64_t group) {
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    ctx->saved_data["group"] = group;
    ctx->saved_data["rows_need_grad"] = rows.requires_grad();
    return exchange(rows, send, recv, *reinterpret_cast<Communicator*>(group));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto& group = *reinterpret_cast<Communicator*>(ctx->saved_data["group"].toInt());
    // The reverse exchange: what came from rank s goes back to rank s.
    auto grad = exchange(grads[0], ctx->saved_data["recv"].toIntVector(),
                         ctx->saved_data["send"].toIntVector(), group);
    if (!ctx->saved_data["rows_need_grad"].toBool()) grad = torch::Tensor();
    return once_differentiable(
        {grad, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()},
        "the MoE's all-to-all exchange");
  }
};

}  // namespace

torch::Tensor exchange_counts(const torch::Tensor& counts, Communicator& group) {
  const int64_t n = group.size();
  auto in = counts.to(torch::kInt64).contiguous();
  auto out = torch::empty_like(in);
  if (n > 1) {
    group.all_to_all_single(out, in).wait();
  } else {
    out.copy_(in);
  }
  return out.view({n, in.numel() / n});
}

std::pair<torch::Tensor, std::vector<int64_t>> exchange_counts(const torch::Tensor& counts,
                                                               const std::vector<int64_t>& words,
                                                               Communicator& group) {
  const int64_t n = group.size(), w = static_cast<int64_t>(words.size());
  auto in = counts.to(torch::kInt64).contiguous();
  const int64_t local = in.numel() / n;
  // Each rank's block: its counts for the peer's experts, then the words.
  auto mine = torch::tensor(words, in.options().device(torch::kCPU)).to(in.device());
  auto out = exchange_counts(
      torch::cat({in.view({n, local}), mine.view({1, w}).expand({n, w})}, 1).view({-1}), group);
  const auto got = out.narrow(1, local, w).cpu().contiguous();
  const int64_t* d = got.data_ptr<int64_t>();
  return {out.narrow(1, 0, local).contiguous(), std::vector<int64_t>(d, d + n * w)};
}

torch::Tensor all_to_all_rows(const torch::Tensor& rows, const torch::Tensor& anchor,
                              const std::vector<int64_t>& send_splits,
                              const std::vector<int64_t>& recv_splits, Communicator& group) {
  const auto handle = static_cast<int64_t>(reinterpret_cast<intptr_t>(&group));
  return AllToAllRows::apply(rows, anchor, send_splits, recv_splits, handle);
}

}  // namespace cohort::expert_parallel
