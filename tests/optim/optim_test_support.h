// defines: the model, data and reference run the optimizer tests share:
// a three-layer net with 61 parameters (not divisible by 2, 3 or 4) and an
// optional layer that never takes part (it gets no gradient), per-rank
// batches fixed before the ranks start, and DDP + a LibTorch optimizer as
// the reference every sharded or fused optimizer must reproduce. A Problem
// made for a device keeps its parameters and batches there.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <mutex>
#include <vector>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"

namespace cohort::testing {

struct OptimNetImpl : torch::nn::Module {
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr}, unused{nullptr};
  explicit OptimNetImpl(bool with_unused = false) {
    a = register_module("a", torch::nn::Linear(7, 5));  // 40
    if (with_unused) unused = register_module("unused", torch::nn::Linear(5, 5));
    b = register_module("b", torch::nn::Linear(5, 3));                                        // 18
    c = register_module("c", torch::nn::Linear(torch::nn::LinearOptions(3, 1).bias(false)));  // 3
  }
  torch::Tensor forward(torch::Tensor x) { return c(torch::tanh(b(torch::tanh(a(x))))); }
};
TORCH_MODULE(OptimNet);

constexpr int kSteps = 20;

// Everything a run needs, made on the main thread (the global RNG is not
// for threads): initial parameters and every rank's batches. The values are
// drawn on the CPU, so they are the same whatever the device.
struct Problem {
  int world = 1;
  bool with_unused = false;
  torch::Device device = torch::kCPU;
  std::vector<torch::Tensor> init;
  torch::Tensor xs, ys;  // [steps, world, rows, features]

  Problem(int w, bool unused = false, int steps = kSteps, torch::Device d = torch::kCPU)
      : world(w), with_unused(unused), device(d) {
    torch::manual_seed(1234);
    OptimNet net(unused);
    for (auto& p : net->parameters()) init.push_back(p.detach().clone().to(d));
    xs = torch::randn({steps, w, 3, 7}).to(d);
    ys = torch::randn({steps, w, 3, 1}).to(d);
  }
  OptimNet make_net() const {
    OptimNet net(with_unused);
    net->to(device);
    torch::NoGradGuard no_grad;
    auto ps = net->parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i].copy_(init[i]);
    return net;
  }
  torch::Tensor loss(OptimNet& net, int step, int rank) const {
    return torch::mse_loss(net->forward(xs[step][rank]), ys[step][rank]);
  }
};

// Final parameters of every rank, collected from the rank threads.
struct RankResults {
  std::mutex mu;
  std::vector<std::vector<torch::Tensor>> params;
  explicit RankResults(int world) : params(world) {}
  void put(int rank, const std::vector<torch::Tensor>& ps) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : ps) params[rank].push_back(p.detach().clone());
  }
};

// The model's parameters in a checkpoint archive ("model_<i>"), next to an
// optimizer's state, and back into the same parameters' storage.
inline void write_parameters(torch::serialize::OutputArchive& archive, torch::nn::Module& net) {
  auto ps = net.parameters();
  for (size_t i = 0; i < ps.size(); ++i) archive.write("model_" + std::to_string(i), ps[i]);
}
inline void read_parameters(torch::serialize::InputArchive& archive, torch::nn::Module& net) {
  torch::NoGradGuard no_grad;
  auto ps = net.parameters();
  for (size_t i = 0; i < ps.size(); ++i) {
    torch::Tensor t;
    archive.read("model_" + std::to_string(i), t);
    ps[i].copy_(t);
  }
}

inline double max_diff(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    d = std::max(d, (a[i] - b[i]).abs().max().item<double>());
  }
  return d;
}

// DDP + the optimizer `make` builds, `steps` steps; rank 0's parameters.
inline std::vector<torch::Tensor> reference_run(
    const Problem& pb,
    const std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>& make,
    int steps = kSteps) {
  RankResults out(pb.world);
  run_ranks_shared(pb.world, [&](std::shared_ptr<Communicator> comm) {
    auto net = pb.make_net();
    DDPOptions o;
    o.find_unused_parameters = pb.with_unused;
    DistributedDataParallel<OptimNet> ddp(net, comm, o);
    auto opt = make(ddp.parameters());
    for (int s = 0; s < steps; ++s) {
      opt->zero_grad();
      torch::mse_loss(ddp.forward(pb.xs[s][comm->rank()]), pb.ys[s][comm->rank()]).backward();
      opt->step();
    }
    out.put(comm->rank(), net->parameters());
  });
  return out.params[0];
}

}  // namespace cohort::testing
