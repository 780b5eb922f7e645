// defines: the small models and helpers the DDP tests share: an MLP, a
// model with layers registered in the opposite order of use (bucket
// rebuild), one with a branch that may be skipped (unused parameters), and
// single-process reference training.
#pragma once

#include <torch/torch.h>

#include <string>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"

namespace cohort::testing {

// A way of running DDP, named for the test's messages.
struct DdpMode {
  std::string name;
  DDPOptions options;
};

// The bucket modes a DDP test covers: the default, gradients of their own,
// a bucket per parameter, find_unused_parameters.
inline std::vector<DdpMode> ddp_bucket_modes() {
  std::vector<DdpMode> out(4);
  out[0].name = "default";
  out[1].name = "gradients of their own";
  out[1].options.gradient_as_bucket_view = false;
  out[2].name = "a bucket per parameter";
  out[2].options.bucket_cap_mb = 1e-6;
  out[2].options.first_bucket_mb = 1e-6;
  out[3].name = "find_unused_parameters";
  out[3].options.find_unused_parameters = true;
  return out;
}

// 8 -> 16 -> 16 -> 4, tanh; small enough that 20 steps at N = 4 take ms.
inline torch::nn::Sequential make_ddp_mlp() {
  return torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

// Registered l3, l2, l1 but applied l1 -> l2 -> l3: the reverse
// registration order (l1 first) is the opposite of the order in which
// backward produces gradients (l3 first).
struct BackwardsNetImpl : torch::nn::Module {
  torch::nn::Linear l3{nullptr}, l2{nullptr}, l1{nullptr};
  BackwardsNetImpl() {
    l3 = register_module("l3", torch::nn::Linear(16, 4));
    l2 = register_module("l2", torch::nn::Linear(16, 16));
    l1 = register_module("l1", torch::nn::Linear(8, 16));
  }
  torch::Tensor forward(torch::Tensor x) {
    return l3(torch::tanh(l2(torch::tanh(l1(x)))));
  }
};
TORCH_MODULE(BackwardsNet);

// `skip` leaves the branch out of the graph.
struct BranchNetImpl : torch::nn::Module {
  torch::nn::Linear trunk{nullptr}, branch{nullptr}, head{nullptr};
  BranchNetImpl() {
    trunk = register_module("trunk", torch::nn::Linear(8, 16));
    branch = register_module("branch", torch::nn::Linear(16, 16));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  torch::Tensor forward(torch::Tensor x, bool skip) {
    auto h = torch::tanh(trunk(x));
    if (!skip) h = h + torch::tanh(branch(h));
    return head(h);
  }
};
TORCH_MODULE(BranchNet);

inline void copy_parameters(torch::nn::Module& to, const std::vector<torch::Tensor>& from) {
  torch::NoGradGuard no_grad;
  auto params = to.parameters();
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(from[i]);
}

inline std::vector<torch::Tensor> clone_all(const std::vector<torch::Tensor>& ts) {
  std::vector<torch::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

// Largest absolute difference over two tensor lists.
inline double max_abs_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>());
  }
  return worst;
}

}  // namespace cohort::testing
