// The GPT with dropout under tensor parallelism, its masks drawn from the
// stage's RngTracker:
//  - ReplicasAgree: after four training steps at tp 2 and 3 (with and
//    without sequence parallelism, with dp 2, activation checkpointing and
//    a pipeline), every parameter replicated over TP is bitwise the same on
//    every TP rank. Each rank seeds LibTorch's default generator its own way
//    first (as a job seeded per rank does; ranks as threads share it): the
//    masks must not come from it. Checked inside each rank, so it runs with
//    ranks as processes too (COHORT_TEST_RANKS=processes under cohortrun:
//    tests/tensor_parallel/CMakeLists.txt).
//  - MatchesOneProcess: four steps at tp 1, 2, 3 against one process that
//    draws the same masks by hand: the replicated regions' from the
//    replicated seed, each TP rank's piece of a sharded region (its heads
//    of the attention probabilities, its rows of the sequence under
//    sequence parallelism) from seed + 2718 + tp_rank, in forward order.
//    Losses and parameters within 1e-5 relative: the TP run sums partial
//    products in another order (row-parallel all-reduces, the vocabulary-
//    parallel cross-entropy), float32 rounding over a few steps, as
//    gpt_equivalence_test. A reference whose sharded masks come from one
//    stream (what tp 1 draws) must miss the TP run: the control.
//
// With COHORT_TEST_DEVICE=cuda the stages, the batches and the reference
// live on the GPU, and the masks come from CUDA generators (the reference
// makes its own as the tracker does: random.h).
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/nn/functional/loss.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <limits>
#include <map>
#include <mutex>

#include "cohort/mesh/gradient_synchronizer.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"

namespace cohort::testing::gpt_dropout_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int kSteps = 4;
constexpr int64_t kBatch = 4;  // global
constexpr double kDropout = 0.2;
constexpr uint64_t kSeed = 7;

GPTConfig config(bool sp, bool checkpointed = false) {
  GPTConfig c;
  c.vocab_size = 12;
  c.seq_len = 6;
  c.hidden = 24;
  c.heads = 6;
  c.layers = 2;
  c.sequence_parallel = sp;
  c.checkpoint_activations = checkpointed;
  c.dropout = kDropout;
  c.seed = kSeed;
  return c;
}

std::pair<torch::Tensor, torch::Tensor> batch(int s, const GPTConfig& c) {
  auto ids =
      torch::randint(c.vocab_size, {kBatch, c.seq_len}, at::detail::createCPUGenerator(100 + s));
  return {ids, (ids * 5 + 3) % c.vocab_size};
}

torch::optim::SGD make_sgd(std::vector<torch::Tensor> params) {
  return torch::optim::SGD(std::move(params), torch::optim::SGDOptions(0.05).momentum(0.9));
}

// One step of a pp 1 stage, as gpt_equivalence_test's; returns the loss.
double step(GPTStage& stage, cohort::GradientSynchronizer& sync, torch::optim::Optimizer& opt,
            const torch::Tensor& ids, const torch::Tensor& targets) {
  opt.zero_grad();
  sync.prepare_forward();
  auto loss = stage->loss(stage(ids), targets);
  sync.after_forward({loss});
  loss.backward();
  sync.finish_backward();
  opt.step();
  return loss.item<double>();
}

// --- ReplicasAgree ---------------------------------------------------------

struct Case {
  int tp, pp, dp;
  bool sp;
  bool checkpointed = false;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& k = info.param;
  return "tp" + std::to_string(k.tp) + (k.pp > 1 ? "_pp" + std::to_string(k.pp) : "") +
         (k.dp > 1 ? "_dp" + std::to_string(k.dp) : "") + (k.sp ? "_sp" : "") +
         (k.checkpointed ? "_checkpointed" : "");
}

class ReplicasAgree : public ::testing::TestWithParam<Case> {};

TEST_P(ReplicasAgree, BitwiseAfterTrainingWithDropout) {
  const auto k = GetParam();
  run_ranks_shared(k.tp * k.pp * k.dp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    torch::manual_seed(1000 + static_cast<uint64_t>(world->rank()));
    auto mesh = init_device_mesh(world, {k.pp, k.dp, k.tp}, {"pp", "dp", "tp"});
    const auto c = config(k.sp, k.checkpointed);
    GPTStage stage(mesh, c);
    stage->to(test_device());  // before the synchronizer and the pipeline take its parameters
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                      stage->shared_embedding_weight());
    auto opt = make_sgd(stage->parameters());
    std::unique_ptr<pipeline::PipelineRuntime> rt;
    if (k.pp > 1) rt = make_gpt_pipeline(mesh, stage, "1f1b", 2);
    const int64_t rows = kBatch / k.dp, dp_rank = mesh.local_rank("dp");
    if (!rt) {
      // Dropout is on: two training forwards of one batch differ.
      torch::NoGradGuard no_grad;
      auto ids = batch(0, c).first.narrow(0, dp_rank * rows, rows).to(test_device());
      ASSERT_FALSE(torch::equal(stage(ids), stage(ids)));
    }
    for (int s = 0; s < kSteps; ++s) {
      auto [ids, targets] = batch(s, c);
      ids = ids.narrow(0, dp_rank * rows, rows).to(test_device());
      targets = targets.narrow(0, dp_rank * rows, rows).to(test_device());
      if (rt) {
        opt.zero_grad();
        rt->step({ids}, {targets});
        sync.synchronize();
        opt.step();
      } else {
        step(stage, sync, opt, ids, targets);
      }
    }
    // Every parameter the TP layers do not split, against TP rank 0's.
    const auto split = split_dims(*stage);
    int replicated = 0, differing = 0;
    for (const auto& p : stage->named_parameters()) {
      if (split.count(p.value().unsafeGetTensorImpl())) continue;
      ++replicated;
      auto first = p.value().detach().clone();
      mesh["tp"].process_group()->broadcast(first, {0}).wait();
      if (torch::equal(first, p.value())) continue;
      ++differing;
      ADD_FAILURE() << p.key() << " on tp rank " << mesh.local_rank("tp") << " (rank "
                    << world->rank() << ") differs from tp rank 0's by up to "
                    << (first - p.value()).abs().max().item<double>();
    }
    EXPECT_GT(replicated, 0);
    EXPECT_EQ(differing, 0) << "of " << replicated << " replicated parameters on rank "
                            << world->rank();
  });
}

INSTANTIATE_TEST_SUITE_P(GPTDropout, ReplicasAgree,
                         ::testing::Values(Case{2, 1, 1, false}, Case{3, 1, 1, false},
                                           Case{2, 1, 1, true}, Case{3, 1, 1, true},
                                           Case{2, 1, 2, false}, Case{2, 1, 1, false, true},
                                           Case{2, 2, 1, false}, Case{2, 2, 1, true, true}),
                         case_name);

// --- MatchesOneProcess -------------------------------------------------------

// A generator of test_device() seeded with `seed`: a CPU generator, or a
// clone of the device's default generator, seeded (as RngTracker makes them).
at::Generator seeded(uint64_t seed) {
  if (test_device().is_cpu()) return at::detail::createCPUGenerator(seed);
  auto gen = at::globalContext().defaultGenerator(test_device()).clone();
  gen.set_current_seed(seed);
  return gen;
}

// The masks of one forward at `tp`, drawn by hand in forward order.
class Masks {
 public:
  // one_stream: every sharded piece from TP rank 0's stream (the control).
  Masks(int tp, bool one_stream) : tp_(tp), one_stream_(one_stream) {
    replicated_ = seeded(kSeed);
    for (int t = 0; t < tp; ++t) sharded_.push_back(seeded(kSeed + 2718 + t));
  }
  // x with the replicated stream's mask.
  torch::Tensor replicated(const torch::Tensor& x) {
    return apply(x, draw(x.sizes(), replicated_));
  }
  // x with each TP rank's mask on its piece along `dim`.
  torch::Tensor sharded(const torch::Tensor& x, int64_t dim) {
    if (one_stream_) return apply(x, draw(x.sizes(), sharded_[0]));
    auto piece = x.sizes().vec();
    piece[dim] /= tp_;
    std::vector<torch::Tensor> keep;
    for (int t = 0; t < tp_; ++t) keep.push_back(draw(piece, sharded_[t]));
    return apply(x, torch::cat(keep, dim));
  }

 private:
  static torch::Tensor draw(at::IntArrayRef sizes, at::Generator& gen) {
    return torch::empty(sizes, torch::TensorOptions().device(test_device()))
        .bernoulli_(1 - kDropout, gen);
  }
  static torch::Tensor apply(const torch::Tensor& x, const torch::Tensor& keep) {
    return x * (keep / (1 - kDropout));
  }
  int tp_;
  bool one_stream_;
  at::Generator replicated_;
  std::vector<at::Generator> sharded_;
};

using Params = std::map<std::string, torch::Tensor>;

// The GPT (gpt_model.h, pp 1, dense) in plain LibTorch on the unsplit
// parameters, with `masks`; returns the mean cross-entropy.
torch::Tensor reference_loss(Params& w, const GPTConfig& c, const torch::Tensor& ids,
                             const torch::Tensor& targets, Masks& masks) {
  const auto T = ids.size(1), B = ids.size(0), H = c.hidden, hd = c.hidden / c.heads;
  const bool sp = c.sequence_parallel;
  auto residual_dropout = [&](const torch::Tensor& x) {
    return sp ? masks.sharded(x, 0) : masks.replicated(x);
  };
  auto norm = [&](const torch::Tensor& x, const std::string& name) {
    return torch::layer_norm(x, {H}, w.at(name + ".weight"), w.at(name + ".bias"));
  };
  auto linear = [&](const torch::Tensor& x, const std::string& name) {
    return torch::linear(x, w.at(name + ".weight"), w.at(name + ".bias"));
  };
  const auto& table = w.at("word_embeddings.weight");
  auto x = table.index_select(0, ids.t().reshape(-1)).view({T, B, H}) +
           w.at("position_embeddings").narrow(0, 0, T).unsqueeze(1);
  x = residual_dropout(x);
  for (int64_t l = 0; l < c.layers; ++l) {
    const auto b = "block" + std::to_string(l);
    auto parts = linear(norm(x, b + ".ln1"), b + ".qkv")
                     .view({T, B, c.heads, 3, hd})
                     .permute({1, 2, 3, 0, 4});  // B, heads, 3, T, hd
    auto q = parts.select(2, 0), k = parts.select(2, 1), v = parts.select(2, 2);
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(hd));
    auto future = torch::ones({T, T}, scores.options().dtype(torch::kBool)).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<float>::infinity());
    auto probs = masks.sharded(torch::softmax(scores, -1), 1);  // each TP rank's heads
    auto attended = torch::matmul(probs, v).permute({2, 0, 1, 3}).reshape({T, B, H});
    x = x + residual_dropout(linear(attended, b + ".proj"));
    auto hidden = torch::gelu(linear(norm(x, b + ".ln2"), b + ".fc1"));
    x = x + residual_dropout(linear(hidden, b + ".fc2"));
  }
  auto logits = torch::matmul(norm(x, "final_layernorm"), table.t());  // [T, B, V]
  return torch::nn::functional::cross_entropy(logits.reshape({-1, c.vocab_size}),
                                              targets.t().reshape({-1}));
}

struct Run {
  std::vector<double> losses;
  std::map<std::string, std::vector<torch::Tensor>> params;  // name -> each TP rank's
};

Run tp_run(int tp, bool sp) {
  Run run;
  std::mutex mu;
  run_ranks_shared(tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, tp}, {"pp", "dp", "tp"});
    const auto c = config(sp);
    GPTStage stage(mesh, c);
    stage->to(test_device());
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                      stage->shared_embedding_weight());
    auto opt = make_sgd(stage->parameters());
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) {
      auto [ids, targets] = batch(s, c);
      losses.push_back(step(stage, sync, opt, ids.to(test_device()), targets.to(test_device())));
    }
    std::lock_guard<std::mutex> lock(mu);
    if (world->rank() == 0) run.losses = losses;
    for (const auto& p : stage->named_parameters()) {
      auto& shards = run.params[p.key()];
      shards.resize(static_cast<size_t>(tp));
      shards[static_cast<size_t>(world->rank())] = p.value().detach().cpu();
    }
  });
  return run;
}

// The same steps in one process, on the tp 1 model's parameters.
Run reference_run(int tp, bool sp, bool one_stream) {
  const auto c = config(sp);
  Params w;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    GPTStage stage(init_device_mesh(world, {1, 1, 1}, {"pp", "dp", "tp"}), c);
    for (const auto& p : stage->named_parameters()) {
      w[p.key()] = p.value().detach().to(test_device()).clone().requires_grad_();
    }
  });
  std::vector<torch::Tensor> leaves;
  for (const auto& [name, p] : w) leaves.push_back(p);
  auto opt = make_sgd(leaves);
  Masks masks(tp, one_stream);
  Run run;
  for (int s = 0; s < kSteps; ++s) {
    auto [ids, targets] = batch(s, c);
    opt.zero_grad();
    auto loss = reference_loss(w, c, ids.to(test_device()), targets.to(test_device()), masks);
    loss.backward();
    opt.step();
    run.losses.push_back(loss.item<double>());
  }
  for (const auto& [name, p] : w) run.params[name] = {p.detach().cpu()};
  return run;
}

double relative_diff(const torch::Tensor& got, const torch::Tensor& want) {
  const double scale = std::max(want.abs().max().item<double>(), 1e-12);
  return (got - want).abs().max().item<double>() / scale;
}

// The slice of `full` a TP rank holding `shard`'s shape keeps.
torch::Tensor matching_slice(const torch::Tensor& full, const torch::Tensor& shard, int tp,
                             int tp_rank) {
  auto out = full;
  for (int64_t d = 0; d < full.dim(); ++d) {
    if (full.size(d) != shard.size(d)) {
      out = out.narrow(d, tp_rank * shard.size(d), shard.size(d));
    }
  }
  return out;
}

struct GoldenCase {
  int tp;
  bool sp;
};

class MatchesOneProcess : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(MatchesOneProcess, FourStepsWithTheSameMasks) {
  const auto [tp, sp] = GetParam();
  const auto got = tp_run(tp, sp);
  const auto want = reference_run(tp, sp, /*one_stream=*/false);
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    EXPECT_LE(std::abs(got.losses[s] - want.losses[s]) / std::abs(want.losses[s]), 1e-5)
        << "step " << s << ": " << got.losses[s] << " vs " << want.losses[s];
  }
  ASSERT_EQ(got.params.size(), want.params.size());
  for (const auto& [name, shards] : got.params) {
    const auto& full = want.params.at(name).front();
    for (int t = 0; t < tp; ++t) {
      const auto& shard = shards[static_cast<size_t>(t)];
      EXPECT_LE(relative_diff(shard, matching_slice(full, shard, tp, t)), 1e-5)
          << name << " on tp rank " << t;
    }
  }
  if (tp == 1) return;
  // The control: sharded masks from one stream miss the TP run.
  const auto wrong = reference_run(tp, sp, /*one_stream=*/true);
  double worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    worst = std::max(worst, std::abs(got.losses[s] - wrong.losses[s]) / std::abs(wrong.losses[s]));
  }
  EXPECT_GT(worst, 1e-3) << "the reference's masks do not decide the comparison";
}

INSTANTIATE_TEST_SUITE_P(GPTDropout, MatchesOneProcess,
                         ::testing::Values(GoldenCase{1, false}, GoldenCase{2, false},
                                           GoldenCase{3, false}, GoldenCase{1, true},
                                           GoldenCase{2, true}, GoldenCase{3, true}),
                         [](const ::testing::TestParamInfo<GoldenCase>& info) {
                           return "tp" + std::to_string(info.param.tp) +
                                  (info.param.sp ? "_sp" : "");
                         });

}  // namespace
}  // namespace cohort::testing::gpt_dropout_test
