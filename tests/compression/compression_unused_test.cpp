// Compression in DDP (find_unused_parameters) when a parameter takes no part
// in a step: outside the graph, or left out by a checkpointed block. One no rank used must be left
// as one process leaves it: its .grad as it was (undefined, or the zeros zero_grad left), and its
// error feedback kept for a later step, since the step's result for it is dropped. One only some
// ranks used gets the average with zeros: on every rank, result = (sum over ranks of (local
// gradient + error spent)) / p + the owner's error spent (int8), the identity every compressor's
// error feedback keeps, with "error spent" its state before minus after.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <string>

#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/compression/compressed_collectives.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"

namespace cohort::testing::compression_unused_test {
namespace {

using compression::CompressionKind;
using State = std::map<std::string, torch::Tensor>;

// tanh(a(x) [+ b(x)] [+ c(x)]), under a head.
struct InnerImpl : torch::nn::Module {
  InnerImpl() {
    a = register_module("a", torch::nn::Linear(8, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
    c = register_module("c", torch::nn::Linear(8, 8));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = a(x);
    if (use_b) h = h + b(x);
    if (use_c) h = h + c(x);
    return torch::tanh(h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  bool use_b = true, use_c = true;
};
TORCH_MODULE(Inner);

// Checkpointed, the inner block's recompute gives no gradient to what it
// left out (DDP learns so at the end of backward); else DDP finds it
// outside the graph at forward.
torch::nn::Sequential make_model(const Inner& inner, bool checkpointed) {
  torch::nn::Sequential seq;
  if (checkpointed) {
    seq->push_back(checkpoint_wrapper(torch::nn::AnyModule(inner)));
  } else {
    seq->push_back(inner);
  }
  seq->push_back(torch::nn::Linear(8, 2));
  torch::NoGradGuard no_grad;
  auto gen = at::detail::createCPUGenerator(7);
  for (auto& p : seq->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
  return seq;
}

// The parameter named `name` or ending in "." + name.
torch::Tensor named(const torch::nn::Module& m, const std::string& name) {
  for (const auto& p : m.named_parameters()) {
    const auto& key = p.key();
    if (key == name ||
        (key.size() > name.size() &&
         key.compare(key.size() - name.size() - 1, std::string::npos, "." + name) == 0)) {
      return p.value();
    }
  }
  throw std::runtime_error("no parameter " + name);
}

// What .grad holds at each step's start.
enum class Grads { None, Zeros, BucketView };

struct Case {
  CompressionKind kind;
  int world;
  Grads grads;
  bool checkpointed;
};

// Steps 0-2 use every parameter (they build error feedback; PowerSGD
// compresses from step 2); in the last, no rank uses b and only rank 0 c.
constexpr int kSteps = 4;

torch::Tensor inputs(int step, int rank) {
  return torch::randn({3, 8}, at::detail::createCPUGenerator(100 + 10 * step + rank));
}
torch::Tensor targets(int step, int rank) {
  return torch::randn({3, 2}, at::detail::createCPUGenerator(200 + 10 * step + rank));
}

compression::CompressionOptions compression_of(CompressionKind kind) {
  compression::CompressionOptions o;
  o.kind = kind;
  o.topk_ratio = 0.25;
  o.powersgd_start_iteration = 2;
  o.powersgd_min_compression_rate = 1;
  return o;
}

// This rank's error feedback spent in the step (before - after) over a
// bucket of n elements: the per-element errors (top-k's, int8's worker
// error, PowerSGD's) summed, and int8's owner error placed at the elements
// this rank owns; zeros where there is no state.
struct Spent {
  torch::Tensor local, owner;
  torch::Tensor held;  // |per-element errors| before the step
};

Spent spent(const State& before, const State& after, int64_t key, int64_t n, int rank, int world) {
  auto get = [&](const State& s, const std::string& what, int64_t size) {
    auto it = s.find(what + "_" + std::to_string(key));
    return it == s.end() ? torch::zeros({size}) : it->second.reshape(-1);
  };
  Spent out{torch::zeros({n}), torch::zeros({n}), torch::zeros({n})};
  for (const char* what : {"topk_error", "int8_worker_error", "powersgd_error"}) {
    out.local += get(before, what, n) - get(after, what, n);
    out.held += get(before, what, n).abs();
  }
  const auto owned = compression::int8_owned_elements(n, 2048, rank, world);
  int64_t size = 0;
  for (auto [offset, count] : owned) size += count;
  const auto owner = get(before, "int8_owner_error", size) - get(after, "int8_owner_error", size);
  int64_t at = 0;
  for (auto [offset, count] : owned) {
    out.owner.narrow(0, offset, count).copy_(owner.narrow(0, at, count));
    at += count;
  }
  return out;
}

// "b.weight" of "0.b.weight" or "0.module.b.weight": the last two parts.
std::string short_name(const std::string& name) {
  const auto last = name.rfind('.');
  const auto before =
      last == std::string::npos || last == 0 ? std::string::npos : name.rfind('.', last - 1);
  return before == std::string::npos ? name : name.substr(before + 1);
}

// One parameter as the last step left it on one rank.
struct Param {
  torch::Tensor grad;   // as the step left it (undefined kept)
  torch::Tensor local;  // this rank's own gradient (zeros when unused)
  Spent spent;          // at its elements
};

std::map<std::string, Param> run_rank(const Case& c, const std::shared_ptr<Communicator>& comm) {
  torch::set_num_threads(1);
  const int r = comm->rank();
  Inner inner, local_inner;
  auto model = make_model(inner, c.checkpointed);
  auto local = make_model(local_inner, false);  // the last step on this rank alone
  DDPOptions options;
  options.find_unused_parameters = true;
  options.gradient_as_bucket_view = c.grads == Grads::BucketView;
  options.compression = compression_of(c.kind);
  DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
  State before;
  for (int s = 0; s < kSteps; ++s) {
    const bool last = s + 1 == kSteps;
    inner->use_b = local_inner->use_b = !last;
    inner->use_c = local_inner->use_c = !last || r == 0;
    ddp.zero_grad(/*set_to_none=*/c.grads == Grads::None);
    if (last) {
      before = ddp.comm_hook()->state();
      torch::NoGradGuard no_grad;
      for (size_t i = 0; i < local->parameters().size(); ++i) {
        local->parameters()[i].copy_(model->parameters()[i]);
      }
    }
    torch::mse_loss(ddp.forward(inputs(s, r)), targets(s, r)).backward();
  }
  torch::mse_loss(local->forward(inputs(kSteps - 1, r)), targets(kSteps - 1, r)).backward();
  const State after = ddp.comm_hook()->state();

  // Where each parameter lies in its bucket (the buckets are laid out in
  // launch order, back to back).
  const auto layout = ddp.reducer().bucket_layout();
  const auto& names = ddp.reducer().parameter_names();
  std::map<std::string, Param> out;  // by short_name
  for (size_t b = 0; b < layout.size(); ++b) {
    int64_t n = 0;
    for (size_t i : layout[b]) n += ddp.reducer().parameters()[i].numel();
    const Spent bucket = spent(before, after, static_cast<int64_t>(b), n, r, c.world);
    int64_t offset = 0;
    for (size_t i : layout[b]) {
      const auto& p = ddp.reducer().parameters()[i];
      const auto g = named(*local, short_name(names[i])).grad();
      Param& q = out[short_name(names[i])];
      q.grad = p.grad().defined() ? p.grad().clone() : torch::Tensor();
      q.local = g.defined() ? g.reshape(-1).clone() : torch::zeros({p.numel()});
      q.spent = {bucket.local.narrow(0, offset, p.numel()),
                 bucket.owner.narrow(0, offset, p.numel()),
                 bucket.held.narrow(0, offset, p.numel())};
      offset += p.numel();
    }
  }
  return out;
}

class CompressionUnusedParameter : public ::testing::TestWithParam<Case> {};

TEST_P(CompressionUnusedParameter, LeftAloneOrAveragedWithZeros) {
  const Case c = GetParam();
  const auto ranks = results_of_ranks<std::map<std::string, Param>>(
      c.world, [&](std::shared_ptr<Communicator> comm) { return run_rank(c, comm); });
  ASSERT_EQ(ranks.size(), static_cast<size_t>(c.world));
  for (const auto& [rank, params] : ranks) {
    for (const char* name : {"b.weight", "b.bias"}) {
      const Param& b = params.at(name);
      // As one process: undefined stays so, zeros stay zeros.
      if (c.grads == Grads::None) {
        EXPECT_FALSE(b.grad.defined())
            << name << " on rank " << rank << " got a .grad, largest |g| "
            << b.grad.abs().max().item<double>();
      } else {
        ASSERT_TRUE(b.grad.defined()) << name << " on rank " << rank;
        EXPECT_EQ(b.grad.abs().max().item<double>(), 0.0)
            << name << " on rank " << rank << ": the zeros became nonzero";
      }
      // Its error feedback is what it was before the step (and was not zero
      // for the weight; PowerSGD's bias goes uncompressed, which at world 1
      // drops nothing).
      const bool stateful = c.kind != CompressionKind::Fp16 && c.kind != CompressionKind::Bf16;
      if (stateful && std::string(name) == "b.weight") {
        EXPECT_GT(b.spent.held.max().item<double>(), 0.0) << name;
      }
      EXPECT_EQ(b.spent.local.abs().max().item<double>(), 0.0)
          << name << " on rank " << rank << ": error feedback changed";
      EXPECT_EQ(b.spent.owner.abs().max().item<double>(), 0.0)
          << name << " on rank " << rank << ": owner error changed";
    }
  }
  // c: used on rank 0 only, averaged with the others' zeros.
  const double p = c.world;
  const double tolerance = c.kind == CompressionKind::Bf16   ? 1e-2
                           : c.kind == CompressionKind::Fp16 ? 2e-3
                                                             : 1e-5;
  for (const char* name : {"c.weight", "c.bias"}) {
    torch::Tensor expected = torch::zeros_like(ranks.at(0).at(name).local);
    for (const auto& [rank, params] : ranks) {
      const Param& q = params.at(name);
      expected += (q.local + q.spent.local) / p + q.spent.owner;
    }
    const double scale = expected.abs().max().item<double>();
    ASSERT_GT(scale, 0.0);
    for (const auto& [rank, params] : ranks) {
      const auto& grad = params.at(name).grad;
      ASSERT_TRUE(grad.defined()) << name << " on rank " << rank;
      EXPECT_LE((grad.reshape(-1) - expected).abs().max().item<double>(), tolerance * scale)
          << name << " on rank " << rank;
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (auto kind : {CompressionKind::Fp16, CompressionKind::Bf16, CompressionKind::Int8,
                    CompressionKind::TopK, CompressionKind::PowerSGD}) {
    for (int world = 1; world <= 3; ++world) {
      for (auto grads : {Grads::None, Grads::Zeros, Grads::BucketView}) {
        for (bool checkpointed : {false, true}) out.push_back({kind, world, grads, checkpointed});
      }
    }
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  static const char* const grads[] = {"none", "zeros", "bucket_view"};
  return compression::to_string(info.param.kind) + "_world" + std::to_string(info.param.world) +
         "_" + grads[static_cast<int>(info.param.grads)] +
         (info.param.checkpointed ? "_checkpointed" : "");
}

INSTANTIATE_TEST_SUITE_P(CompressorsWorldsGrads, CompressionUnusedParameter,
                         ::testing::ValuesIn(cases()), case_name);

}  // namespace
}  // namespace cohort::testing::compression_unused_test
