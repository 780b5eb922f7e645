// The GPT with experts (a MoE feed-forward every other block, experts split
// over the mesh's "ep" and each expert's FFN over "tp") and with context
// parallelism (ring attention over "cp", the zig-zag split of the sequence),
// trained five steps through the GradientSynchronizer against the same model
// in one process: every step's loss, the first step's global gradient norm
// (MeshGradNorm, what the Trainer clips by) and, at the end, every parameter
// (each shard against the matching slice of the reference) within 1e-5
// relative.
//
// The reference is one process on the global batch. With experts it runs the
// dense ranks' shards of the batch one after another and accumulates
// loss / shards: routing, capacity and the load-balancing loss are per rank's
// tokens, so that is the model the ranks train together.
//
// Negative controls: the same check rejects a run whose expert gradients are
// averaged over the replicas only (ep times too large, the mistake the
// divisor guards against) and a run whose ring skips one K/V block.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/sgd.h>

#include <functional>
#include <mutex>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/wiring/mesh_wiring.h"
#include "examples/models/gpt_model.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"

namespace cohort::testing::gpt_expert_context_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int kSteps = 5;
constexpr int64_t kBatch = 4;  // global

struct Case {
  int dp, ep, cp, tp;
  int ring_skip_step = -1;             // negative control: a K/V block left out
  bool experts_over_replicas = false;  // negative control: experts ep times too large
};

bool moe(const Case& k) { return k.ep > 1; }

GPTConfig config(bool with_experts, int ring_skip_step = -1) {
  GPTConfig c;
  c.vocab_size = 12;
  c.seq_len = 8;
  c.hidden = 16;
  c.heads = 4;
  c.layers = 2;
  c.seed = 7;
  c.ring_skip_step = ring_skip_step;
  if (with_experts) {
    // Two experts per token, one slot per token and expert on average:
    // some assignments are dropped (capacity 4 of 8 tokens' 16 choices).
    c.experts = 4;
    c.top_k = 2;
    c.capacity_factor = 1.0;
    c.aux_loss_coef = 0.05;
  }
  return c;
}

// Step s's global batch: random ids and learnable targets, [kBatch, T].
std::pair<torch::Tensor, torch::Tensor> batch(int s, const GPTConfig& c) {
  auto ids =
      torch::randint(c.vocab_size, {kBatch, c.seq_len}, at::detail::createCPUGenerator(200 + s));
  return {ids, (ids * 5 + 3) % c.vocab_size};
}

struct Shard {
  std::string name;
  int ep_rank = 0, tp_rank = 0;
  torch::Tensor value;
};

struct Result {
  std::vector<double> losses;  // global mean per step
  double first_norm = 0;       // the global gradient norm of step 0
  std::vector<Shard> params;   // every rank's, at the end
};

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, const Case& k) {
  return init_device_mesh(std::move(world), {1, k.dp, k.ep, k.cp, k.tp},
                          {"pp", "dp", "ep", "cp", "tp"});
}

// One process: the global batch as `shards` row blocks (the dense ranks'),
// their losses / shards accumulated.
Result reference(bool with_experts, int shards) {
  Result result;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, {1, 1, 1, 1});
    const auto c = config(with_experts);
    GPTStage stage(mesh, c);
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    const auto rows = kBatch / shards;
    for (int s = 0; s < kSteps; ++s) {
      auto [ids, targets] = batch(s, c);
      opt.zero_grad();
      double total = 0;
      for (int r = 0; r < shards; ++r) {
        auto loss =
            stage->loss(stage(ids.narrow(0, r * rows, rows)), targets.narrow(0, r * rows, rows)) /
            shards;
        loss.backward();
        total += loss.item<double>();
      }
      if (s == 0) {
        double sq = 0;
        for (const auto& p : stage->parameters()) sq += p.grad().pow(2).sum().item<double>();
        result.first_norm = std::sqrt(sq);
      }
      opt.step();
      result.losses.push_back(total);
    }
    for (const auto& p : stage->named_parameters()) {
      result.params.push_back({p.key(), 0, 0, p.value().detach().clone()});
    }
  });
  return result;
}

Result train(const Case& k) {
  Result result;
  std::mutex mu;
  run_ranks_shared(k.dp * k.ep * k.cp * k.tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, k);
    const auto c = config(moe(k), k.ring_skip_step);
    GPTStage stage(mesh, c);
    cohort::GradientSynchronizerOptions options;
    options.expert_parameters = stage->expert_parameters();
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight(),
                                      options);
    torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
    // The dense rank (dp, ep row-major) picks the rows; cp its columns.
    const auto dense = mesh.local_rank("dp") * k.ep + mesh.local_rank("ep");
    const auto rows = kBatch / (k.dp * k.ep);
    std::vector<double> losses;
    MeshGradNorm norm(mesh, *stage, {});  // the Trainer's clipping norm
    double first_norm = 0;
    for (int s = 0; s < kSteps; ++s) {
      auto [ids, targets] = batch(s, c);
      ids = stage->local_sequence(ids.narrow(0, dense * rows, rows));
      targets = stage->local_sequence(targets.narrow(0, dense * rows, rows));
      opt.zero_grad();
      sync.prepare_forward();
      auto loss = stage->loss(stage(ids), targets);
      sync.after_forward({loss});
      loss.backward();
      sync.finish_backward();
      if (k.experts_over_replicas) {
        torch::NoGradGuard no_grad;
        for (auto& p : options.expert_parameters) p.mutable_grad().mul_(k.ep);
      }
      if (s == 0) first_norm = norm.global_norm(stage->parameters());
      opt.step();
      auto l = loss.detach().clone();
      sync.dense_group()->all_reduce(l, {ReduceOp::Avg}).wait();
      losses.push_back(l.item<double>());
    }
    std::lock_guard<std::mutex> lock(mu);
    if (world->rank() == 0) result.losses = losses, result.first_norm = first_norm;
    for (const auto& p : stage->named_parameters()) {
      result.params.push_back(
          {p.key(), mesh.local_rank("ep"), mesh.local_rank("tp"), p.value().detach().clone()});
    }
  });
  return result;
}

const Result& reference_for(const Case& k) {
  static const Result dense = reference(false, 1);
  static const Result ep2 = reference(true, 2);
  static const Result dp2_ep2 = reference(true, 4);
  if (!moe(k)) return dense;
  return k.dp * k.ep == 4 ? dp2_ep2 : ep2;
}

// The slice of `full` a shard holds: experts split dimension 0 over ep and
// their FFN dimension over tp, the TP layers their split dimension over tp.
torch::Tensor matching_slice(const torch::Tensor& full, const Shard& shard) {
  const bool expert = shard.name.find(".moe.") != std::string::npos &&
                      shard.name.find(".moe.router") == std::string::npos;
  auto out = full;
  for (int64_t d = 0; d < full.dim(); ++d) {
    const auto n = shard.value.size(d);
    if (full.size(d) != n)
      out = out.narrow(d, (expert && d == 0 ? shard.ep_rank : shard.tp_rank) * n, n);
  }
  return out;
}

// The largest relative difference of the run from the reference: over the
// losses and every parameter shard.
double largest_difference(const Result& got, const Result& ref, const Case& k) {
  EXPECT_EQ(got.losses.size(), ref.losses.size());
  double worst = std::abs(got.first_norm - ref.first_norm) / ref.first_norm;
  for (size_t s = 0; s < got.losses.size() && s < ref.losses.size(); ++s) {
    worst = std::max(worst, std::abs(got.losses[s] - ref.losses[s]) / std::abs(ref.losses[s]));
  }
  EXPECT_EQ(got.params.size(), ref.params.size() * static_cast<size_t>(k.dp * k.ep * k.cp * k.tp));
  for (const auto& shard : got.params) {
    const Shard* want = nullptr;
    for (const auto& r : ref.params) {
      if (r.name == shard.name) want = &r;
    }
    EXPECT_NE(want, nullptr) << shard.name;
    if (!want) continue;
    const auto expected = matching_slice(want->value, shard);
    EXPECT_EQ(expected.sizes().vec(), shard.value.sizes().vec()) << shard.name;
    const double scale = std::max(expected.abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (shard.value - expected).abs().max().item<double>() / scale);
  }
  return worst;
}

std::string case_name(const Case& k) {
  return "dp" + std::to_string(k.dp) + "_ep" + std::to_string(k.ep) + "_cp" + std::to_string(k.cp) +
         "_tp" + std::to_string(k.tp);
}

class GPTExpertContext : public ::testing::TestWithParam<Case> {};

TEST_P(GPTExpertContext, FiveStepsMatchSingleProcess) {
  const auto k = GetParam();
  const auto& ref = reference_for(k);
  ASSERT_EQ(ref.losses.size(), static_cast<size_t>(kSteps));
  // Training must have moved: otherwise equality would prove little.
  ASSERT_GT(std::abs(ref.losses.back() - ref.losses.front()), 0.01);
  const auto got = train(k);
  EXPECT_LE(largest_difference(got, ref, k), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Meshes, GPTExpertContext,
                         ::testing::Values(Case{2, 2, 1, 1}, Case{1, 2, 1, 2}, Case{1, 1, 2, 2},
                                           Case{2, 1, 2, 1}),
                         [](const auto& info) { return case_name(info.param); });

// The same check rejects a run that is wrong in the way each dimension can
// be: expert gradients averaged over the replicas only (dp2 x ep2), and a
// ring that leaves out the K/V block of step 1 (cp2 x tp2).
TEST(GPTExpertContextControls, WrongRunsAreRejected) {
  Case experts{2, 2, 1, 1};
  experts.experts_over_replicas = true;
  EXPECT_GT(largest_difference(train(experts), reference_for(experts), experts), 1e-3);
  Case ring{1, 1, 2, 2};
  ring.ring_skip_step = 1;
  EXPECT_GT(largest_difference(train(ring), reference_for(ring), ring), 1e-3);
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Layouts the model does not take: named on every rank before any block.
TEST(GPTExpertContextErrors, RefusedLayoutsAreNamed) {
  auto errors = errors_on_every_rank(2, [](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 2, 1, 1});
    GPTStage stage(mesh, config(false));
  });
  for (const auto& e : errors) EXPECT_TRUE(has(e, "splits experts over ep 2")) << e;
  errors = errors_on_every_rank(2, [](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 1, 2, 1});
    auto c = config(false);
    c.seq_len = 6;
    GPTStage stage(mesh, c);
  });
  for (const auto& e : errors) EXPECT_TRUE(has(e, "seq_len 6 does not divide into 2 x cp 2")) << e;
  // Ring attention has no attention-probability dropout.
  errors = errors_on_every_rank(2, [](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 1, 2, 1});
    auto c = config(false);
    c.dropout = 0.1;
    GPTStage stage(mesh, c);
  });
  for (const auto& e : errors) EXPECT_TRUE(has(e, "ring attention has no attention dropout")) << e;
}

}  // namespace
}  // namespace cohort::testing::gpt_expert_context_test
