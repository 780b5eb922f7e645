// Each mapping is a torch::autograd::Function. Tensors handed to the
// communicator are detached: an algorithm may run its arithmetic on its own
// thread, where grad mode is on, and out= kernels refuse inputs that require
// grad. The communicator cannot be
// stored in ctx->saved_data (an IValue map), so its address travels as an
// integer; the layers keep the communicator alive for the graph's lifetime.
#include "cohort/tensor_parallel/mappings.h"

#include <torch/autograd.h>

#include "cohort/core/error.h"

namespace cohort::tensor_parallel {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

int64_t handle(Communicator& c) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(&c)); }

torch::Tensor all_reduce(const torch::Tensor& t, Communicator& g) {
  auto out = t.detach().contiguous().clone();
  if (g.size() > 1) g.all_reduce(out).wait();
  return out;
}

// Concatenates every rank's `t` along `dim`.
torch::Tensor all_gather(const torch::Tensor& t, Communicator& g, int64_t dim) {
  if (g.size() == 1) return t.clone();
  auto in = t.detach().movedim(dim, 0).contiguous();
  auto sizes = in.sizes().vec();
  sizes[0] *= g.size();
  auto out = torch::empty(sizes, in.options());
  g.all_gather_into_tensor(out, in).wait();
  return out.movedim(0, dim).contiguous();
}

// Sums over ranks and keeps this rank's slice of dimension 0.
torch::Tensor reduce_scatter(const torch::Tensor& t, Communicator& g) {
  if (g.size() == 1) return t.clone();
  auto in = t.detach().contiguous();
  split_along(in, 0, g.rank(), g.size(), "reduce_scatter_to_sequence_parallel_region");
  auto sizes = in.sizes().vec();
  sizes[0] /= g.size();
  auto out = torch::empty(sizes, in.options());
  g.reduce_scatter_tensor(out, in).wait();
  return out;
}

torch::Tensor split(const torch::Tensor& t, Communicator& g, int64_t dim, const char* what) {
  return split_along(t, dim, g.rank(), g.size(), what).contiguous();
}

// Each backward applies its conjugate mapping, itself an autograd function:
// under a plain backward that is just the collective, and under
// create_graph it puts the conjugate's own backward (this forward) in the
// graph, so a second derivative through TP is exact. A replicated tensor's
// gradient is whole on every rank, a partial one sums over ranks, at every
// order.
struct ReduceFromRegion;

struct CopyToRegion : torch::autograd::Function<CopyToRegion> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return x;  // LibTorch wraps an input returned as is in a fresh view
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct ReduceFromRegion : torch::autograd::Function<ReduceFromRegion> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return all_reduce(x, *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group)));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {CopyToRegion::apply(grads[0], ctx->saved_data["group"].toInt()), torch::Tensor()};
  }
};

variable_list CopyToRegion::backward(AutogradContext* ctx, variable_list grads) {
  return {ReduceFromRegion::apply(grads[0], ctx->saved_data["group"].toInt()), torch::Tensor()};
}

// Split / all-gather pairs along one dimension (kDim < 0: the last).
int64_t dim_of(int64_t k, const torch::Tensor& t) { return k < 0 ? t.dim() - 1 : k; }

template <int64_t kDim>
struct GatherFrom;

template <int64_t kDim>
struct ScatterTo : torch::autograd::Function<ScatterTo<kDim>> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    auto& g = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group));
    return split(
        x, g, dim_of(kDim, x),
        kDim < 0 ? "scatter_to_tensor_parallel_region" : "scatter_to_sequence_parallel_region");
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {GatherFrom<kDim>::apply(grads[0], ctx->saved_data["group"].toInt()), torch::Tensor()};
  }
};

template <int64_t kDim>
struct GatherFrom : torch::autograd::Function<GatherFrom<kDim>> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    auto& g = *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group));
    return all_gather(x, g, dim_of(kDim, x));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {ScatterTo<kDim>::apply(grads[0], ctx->saved_data["group"].toInt()), torch::Tensor()};
  }
};

// The sequence-parallel pair: the all-gather's consumers on every rank add
// to each slice's gradient, so its backward reduce-scatters.
struct ReduceScatterTo;

struct GatherPartialsFrom : torch::autograd::Function<GatherPartialsFrom> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return all_gather(x, *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group)), 0);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads);
};

struct ReduceScatterTo : torch::autograd::Function<ReduceScatterTo> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t group) {
    ctx->saved_data["group"] = group;
    return reduce_scatter(x, *reinterpret_cast<Communicator*>(static_cast<intptr_t>(group)));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {GatherPartialsFrom::apply(grads[0], ctx->saved_data["group"].toInt()), torch::Tensor()};
  }
};

variable_list GatherPartialsFrom::backward(AutogradContext* ctx, variable_list grads) {
  return {ReduceScatterTo::apply(grads[0], ctx->saved_data["group"].toInt()), torch::Tensor()};
}

}  // namespace

torch::Tensor split_along(const torch::Tensor& t, int64_t dim, int rank, int size,
                          const std::string& what) {
  const auto n = t.size(dim);
  if (n % size != 0) {
    throw InvalidArgument("cohort: " + what + " (rank " + std::to_string(rank) + "): size " +
                          std::to_string(n) + " of dimension " + std::to_string(dim) +
                          " does not divide by the tensor-parallel size " + std::to_string(size));
  }
  return t.narrow(dim, rank * (n / size), n / size);
}

torch::Tensor copy_to_tensor_parallel_region(const torch::Tensor& x, Communicator& g) {
  return CopyToRegion::apply(x, handle(g));
}
torch::Tensor reduce_from_tensor_parallel_region(const torch::Tensor& x, Communicator& g) {
  return ReduceFromRegion::apply(x, handle(g));
}
torch::Tensor scatter_to_tensor_parallel_region(const torch::Tensor& x, Communicator& g) {
  return ScatterTo<-1>::apply(x, handle(g));
}
torch::Tensor gather_from_tensor_parallel_region(const torch::Tensor& x, Communicator& g) {
  return GatherFrom<-1>::apply(x, handle(g));
}
torch::Tensor scatter_to_sequence_parallel_region(const torch::Tensor& x, Communicator& g) {
  return ScatterTo<0>::apply(x, handle(g));
}
torch::Tensor gather_from_sequence_parallel_region(const torch::Tensor& x, Communicator& g,
                                                   bool tensor_parallel_output_grad) {
  // A replicated consumer's gradient is whole on every rank: the split pair.
  if (!tensor_parallel_output_grad) return GatherFrom<0>::apply(x, handle(g));
  return GatherPartialsFrom::apply(x, handle(g));
}
torch::Tensor reduce_scatter_to_sequence_parallel_region(const torch::Tensor& x, Communicator& g) {
  return ReduceScatterTo::apply(x, handle(g));
}

}  // namespace cohort::tensor_parallel
