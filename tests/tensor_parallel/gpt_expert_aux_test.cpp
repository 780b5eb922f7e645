// The GPT's load-balancing losses (experts, aux_loss_coef 0.5 so that a
// wrong one shows) against one process.
//
// Under context parallelism each cp rank routes its own tokens, but the
// load-balancing loss is the whole sequences': the loss, every rank's
// aux_loss() and, after the GradientSynchronizer, every gradient (routers
// included) equal one process's on the same rows within 1e-5. The capacity
// drops nothing (capacity is per rank's tokens, as in Megatron-Core), so
// that the aux loss is the only thing cp could change.
//
// A forward run between a micro-batch's forward and its loss (an
// evaluation, another micro-batch) must leave that micro-batch's
// load-balancing value and gradient alone.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <map>
#include <mutex>

#include "cohort/core/error.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "examples/models/gpt_model.h"
#include "support/thread_ranks.h"

namespace cohort::testing::gpt_expert_aux_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kBatch = 4;  // global rows: split over ep

GPTConfig config() {
  GPTConfig c;
  c.vocab_size = 12;
  c.seq_len = 12;  // 2 x cp equal chunks at cp 2 and 3
  c.hidden = 16;
  c.heads = 4;
  c.layers = 2;
  c.seed = 7;
  c.experts = 4;
  c.top_k = 2;
  c.capacity_factor = 4.0;  // C = T k: nothing dropped at any cp
  c.aux_loss_coef = 0.5;
  return c;
}

std::pair<torch::Tensor, torch::Tensor> batch(uint64_t seed, int64_t rows) {
  const auto c = config();
  auto ids = torch::randint(c.vocab_size, {rows, c.seq_len}, at::detail::createCPUGenerator(seed));
  return {ids, (ids * 5 + 3) % c.vocab_size};
}

struct Grad {
  std::string name;
  int ep_rank = 0, tp_rank = 0;
  torch::Tensor value;
};

struct Run {
  std::vector<double> loss, aux;  // per dense shard (reference) or rank (run)
  std::vector<int> shard;         // the run's: each rank's dense shard
  std::vector<Grad> grads;
};

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, int ep, int cp, int tp) {
  return init_device_mesh(std::move(world), {1, 1, ep, cp, tp}, {"pp", "dp", "ep", "cp", "tp"});
}

// One process: the batch as `shards` row blocks, each loss / shards.
Run reference(int shards) {
  Run out;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    GPTStage stage(mesh_of(world, 1, 1, 1), config());
    auto [ids, targets] = batch(5, kBatch);
    const auto rows = kBatch / shards;
    for (int r = 0; r < shards; ++r) {
      auto loss =
          stage->loss(stage(ids.narrow(0, r * rows, rows)), targets.narrow(0, r * rows, rows));
      out.loss.push_back(loss.item<double>());
      out.aux.push_back(stage->aux_loss().item<double>());
      (loss / shards).backward();
    }
    for (const auto& p : stage->named_parameters()) {
      out.grads.push_back({p.key(), 0, 0, p.value().grad().clone()});
    }
  });
  return out;
}

// At (ep, cp, tp): every rank's loss, aux_loss() and synchronized gradients.
Run distributed(int ep, int cp, int tp) {
  Run out;
  std::mutex mu;
  run_ranks_shared(ep * cp * tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, ep, cp, tp);
    GPTStage stage(mesh, config());
    cohort::GradientSynchronizerOptions options;
    options.expert_parameters = stage->expert_parameters();
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight(),
                                      options);
    auto [ids, targets] = batch(5, kBatch);
    const int64_t rows = kBatch / ep, shard = mesh.local_rank("ep");
    ids = stage->local_sequence(ids.narrow(0, shard * rows, rows));
    targets = stage->local_sequence(targets.narrow(0, shard * rows, rows));
    sync.prepare_forward();
    auto loss = stage->loss(stage(ids), targets);
    sync.after_forward({loss});
    loss.backward();
    sync.finish_backward();
    std::lock_guard<std::mutex> lock(mu);
    out.loss.push_back(loss.item<double>());
    out.aux.push_back(stage->aux_loss().item<double>());
    out.shard.push_back(static_cast<int>(shard));
    for (const auto& p : stage->named_parameters()) {
      out.grads.push_back(
          {p.key(), static_cast<int>(shard), mesh.local_rank("tp"), p.value().grad().clone()});
    }
  });
  return out;
}

// The slice of `full` a shard holds: experts split dimension 0 over ep and
// their FFN dimension over tp, the TP layers their split dimension over tp.
torch::Tensor matching_slice(const torch::Tensor& full, const Grad& shard) {
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

double relative(double got, double want) { return std::abs(got - want) / std::abs(want); }

// Every gradient against the reference's, relative to its largest element;
// returns how many routers were compared.
int expect_gradients(const std::vector<Grad>& got, const std::vector<Grad>& want) {
  std::map<std::string, torch::Tensor> ref;
  for (const auto& g : want) ref[g.name] = g.value;
  int routers = 0;
  for (const auto& g : got) {
    if (!ref.count(g.name)) {
      ADD_FAILURE() << g.name << " is not in the reference";
      continue;
    }
    const auto expected = matching_slice(ref.at(g.name), g);
    const double scale = std::max(expected.abs().max().item<double>(), 1e-12);
    const double off = (g.value - expected).abs().max().item<double>();
    EXPECT_LE(off / scale, 1e-5) << g.name << ": " << off << " off, largest element " << scale;
    routers += g.name.find(".moe.router") != std::string::npos;
  }
  return routers;
}

struct Case {
  int ep, cp, tp;
};

class GPTExpertAuxLoss : public ::testing::TestWithParam<Case> {};

TEST_P(GPTExpertAuxLoss, ContextParallelMatchesOneProcess) {
  const auto k = GetParam();
  const auto want = reference(k.ep);
  ASSERT_GT(want.aux[0], 0.4);  // aux_loss_coef 0.5 x a loss near 1: it counts
  const auto got = distributed(k.ep, k.cp, k.tp);
  ASSERT_EQ(got.loss.size(), static_cast<size_t>(k.ep * k.cp * k.tp));
  for (size_t r = 0; r < got.loss.size(); ++r) {
    const auto s = static_cast<size_t>(got.shard[r]);
    EXPECT_LE(relative(got.aux[r], want.aux[s]), 1e-5)
        << "aux_loss " << got.aux[r] << ", one process " << want.aux[s];
    EXPECT_LE(relative(got.loss[r], want.loss[s]), 1e-5)
        << "loss " << got.loss[r] << ", one process " << want.loss[s];
  }
  EXPECT_EQ(expect_gradients(got.grads, want.grads), k.ep * k.cp * k.tp) << "routers compared";
}

INSTANTIATE_TEST_SUITE_P(Meshes, GPTExpertAuxLoss,
                         ::testing::Values(Case{1, 1, 1}, Case{1, 2, 1}, Case{1, 3, 1},
                                           Case{1, 2, 2}, Case{2, 2, 1}),
                         [](const auto& info) {
                           return "ep" + std::to_string(info.param.ep) + "_cp" +
                                  std::to_string(info.param.cp) + "_tp" +
                                  std::to_string(info.param.tp);
                         });

// Two micro-batches held at once with an evaluation forward in between: the
// values and gradients of running each micro-batch's forward and loss in
// turn.
TEST(GPTExpertAuxLossInterleaved, EachLossKeepsItsMicroBatch) {
  const auto first = batch(11, 2), second = batch(12, 2), evaluation = batch(13, 2);
  std::vector<double> want_loss, got_loss;
  std::vector<Grad> want, got;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    const auto& [a, ta] = first;
    const auto& [b, tb] = second;
    const auto& [e, te] = evaluation;
    GPTStage plain(mesh_of(world, 1, 1, 1), config());
    for (const auto& [ids, t] : {std::pair{a, ta}, std::pair{b, tb}}) {
      auto loss = plain->loss(plain(ids), t);
      want_loss.push_back(loss.item<double>());
      (loss / 2).backward();
    }
    {
      torch::NoGradGuard no_grad;
      want_loss.push_back(plain->loss(plain(e), te).item<double>());
    }
    for (const auto& p : plain->named_parameters())
      want.push_back({p.key(), 0, 0, p.value().grad().clone()});

    GPTStage stage(mesh_of(world, 1, 1, 1), config());
    auto out_a = stage(a);
    {
      torch::NoGradGuard no_grad;
      stage->eval();
      got_loss.push_back(stage->loss(stage(e), te).item<double>());
      stage->train();
    }
    auto out_b = stage(b);
    auto loss_b = stage->loss(out_b, tb);
    auto loss_a = stage->loss(out_a, ta);
    ((loss_a + loss_b) / 2).backward();
    got_loss.insert(got_loss.begin(), {loss_a.item<double>(), loss_b.item<double>()});
    for (const auto& p : stage->named_parameters())
      got.push_back({p.key(), 0, 0, p.value().grad().clone()});
  });
  ASSERT_EQ(got_loss.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_LE(relative(got_loss[i], want_loss[i]), 1e-6)
        << "loss " << i << " (a, b, evaluation): " << got_loss[i] << ", in turn " << want_loss[i];
  }
  EXPECT_EQ(expect_gradients(got, want), 1) << "routers compared";
}

// loss() of a tensor no forward of the stage returned: the micro-batch's
// load-balancing losses are unknown, so it is refused by name.
TEST(GPTExpertAuxLossInterleaved, LossOfAnotherTensorIsRefused) {
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    GPTStage stage(mesh_of(world, 1, 1, 1), config());
    auto [ids, t] = batch(11, 2);
    auto logits = stage(ids);
    try {
      stage->loss(logits.clone(), t);
      ADD_FAILURE() << "loss() of a copy of the logits was taken";
    } catch (const InvalidArgument& error) {
      EXPECT_NE(std::string(error.what()).find("loss: the tensor is not (a view of) an output"),
                std::string::npos)
          << error.what();
    }
  });
}

}  // namespace
}  // namespace cohort::testing::gpt_expert_aux_test
