// Determinism::WorldSizeInvariant, for DDP and for ZeRO-2 over DDP (one
// test per mode and model): a CNN with BatchNorm and a small transformer,
// AdamW with gradient clipping, 20 steps: parameters and buffers bitwise
// equal (bytes compared) at worlds 1, 2, 4, 8 with L = 8 and 1, 3, 6 with
// L = 12, and through an elastic resume 4 -> 3 (L = 12: the state saved
// after 10 steps at world 4, 10 more at world 3). ZeRO-2 clips by the
// canonical norm (ZeroRedundancyOptimizer::clip_grad_norm). Negative
// control: without the option, the same leaf loop (no_sync accumulation,
// ring all-reduce or reduce-scatter) differs between worlds 1 and 4, and the
// test prints by how much. FSDP with the option (FullyShard::clip_grad_norm):
// the same models, bitwise at the worlds each test names and through an
// elastic resume 4 -> 3 resharded by dcp (check_fsdp). The
// canonical tree's shape, the canonical norm, world 1's mean against plain
// LibTorch and the refused uses are checked too.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "cohort/core/torch_compat.h"
#include "cohort/dcp/dcp.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/grad_sync/canonical_norm.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "cohort/plan/grad_norm.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"
#include "tests/ddp/determinism_support.h"

namespace cohort::testing::determinism_test {
namespace {

enum class Mode { Ddp, Zero2 };

// Loads consolidated AdamW state into this rank's ZeRO pieces (a resharding
// resume: the pieces of world 3 are not those of world 4).
void load_zero_state(ZeroRedundancyOptimizer& zero,
                     const std::vector<std::map<std::string, torch::Tensor>>& full) {
  const auto& part = zero.partition();
  for (size_t k = 0; k < part.pieces().size(); ++k) {
    const auto& piece = part.pieces()[k];
    const auto& m = full.at(piece.param);
    if (m.empty()) continue;
    auto slice = [&](const char* name) {
      return m.at(name).reshape(-1).narrow(0, piece.param_offset, piece.numel).clone();
    };
    auto state = std::make_unique<torch::optim::AdamWParamState>();
    state->step(m.at("step").item<int64_t>());
    state->exp_avg(slice("exp_avg"));
    state->exp_avg_sq(slice("exp_avg_sq"));
    zero.shard_optimizer().state()[optimizer_state_key(zero.shard_pieces()[k])] = std::move(state);
  }
}

// Trains `world` ranks on steps [begin, end) of `data` from `from` and
// returns every rank's parameters followed by its buffers (rank 0's state
// and optimizer go to `to` if given). With `deterministic`, one forward and
// backward per leaf; without, the same leaves under no_sync() but the last,
// each loss scaled by 1 / local leaves (DDP then averages over ranks).
template <typename Holder>
std::vector<std::vector<torch::Tensor>> train(Mode mode, int world, int64_t leaves,
                                              bool deterministic, const Data& data,
                                              const Checkpoint& from, int begin = 0,
                                              int end = kSteps, Checkpoint* to = nullptr) {
  std::vector<std::vector<torch::Tensor>> got(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Holder model;
    load_model(*model, from);
    DDPOptions options;
    ZeroOptions zero_options;
    zero_options.stage = 2;
    if (deterministic) {
      options.determinism = zero_options.determinism = Determinism::WorldSizeInvariant;
      options.leaves = zero_options.leaves = leaves;
    }
    DistributedDataParallel<Holder> ddp(model, comm, options);
    const auto adamw = torch::optim::AdamWOptions(0.01).weight_decay(0.01);
    std::unique_ptr<torch::optim::AdamW> opt;
    std::unique_ptr<ZeroRedundancyOptimizer> zero;
    if (mode == Mode::Ddp) {
      opt = std::make_unique<torch::optim::AdamW>(ddp.parameters(), adamw);
      if (!from.optimizer.empty()) {
        std::istringstream bytes(from.optimizer);
        torch::serialize::InputArchive archive;
        archive.load_from(bytes);
        opt->load(archive);
      }
    } else {
      zero = ZeroRedundancyOptimizer::make<torch::optim::AdamW>(ddp, adamw, zero_options);
      if (!from.zero.empty()) load_zero_state(*zero, from.zero);
    }
    ShardedGradNorm sharded(comm);
    const int64_t local = leaves / world;
    const int64_t first = local * comm->rank();
    for (int s = begin; s < end; ++s) {
      opt ? opt->zero_grad() : zero->zero_grad();
      for (int64_t l = first; l < first + local; ++l) {
        // A leaf is a tensor of its own (fresh, aligned storage), as a loader's batch.
        auto x = data.xs[s][l].clone();
        auto y = data.ys[s][l].clone();
        if (deterministic) {
          torch::mse_loss(ddp.forward(x), y).backward();
        } else if (l + 1 < first + local) {
          auto guard = ddp.no_sync();
          (torch::mse_loss(ddp.forward(x), y) / static_cast<double>(local)).backward();
        } else {
          (torch::mse_loss(ddp.forward(x), y) / static_cast<double>(local)).backward();
        }
      }
      constexpr double kMaxNorm = 0.05;  // active: norms are ~0.1-1
      if (opt) {
        torch::nn::utils::clip_grad_norm_(ddp.parameters(), kMaxNorm);
        opt->step();
      } else if (deterministic) {
        zero->clip_grad_norm(kMaxNorm);
        zero->step();
      } else {
        zero->finish_gradients();
        const auto& pieces = zero->shard_pieces();
        clip_grad_norm(pieces, sharded.global_norm(pieces), kMaxNorm);
        zero->step();
      }
    }
    got[comm->rank()] = all_state(*model);
    auto consolidated = zero ? zero->consolidate_state_dict(0)
                             : std::vector<std::map<std::string, torch::Tensor>>{};
    if (to && comm->rank() == 0) {
      to->state = got[0];
      to->zero = consolidated;
      if (opt) {
        torch::serialize::OutputArchive archive;
        opt->save(archive);
        std::ostringstream bytes;
        archive.save_to(bytes);
        to->optimizer = bytes.str();
      }
    }
  });
  return got;
}

// Where an FSDP run starts and stops: its steps [begin, end), and the dcp
// checkpoint folders it resumes from and saves to (empty: none).
struct FsdpRun {
  int begin = 0, end = kSteps;
  std::string load, save;
};

// train() for FSDP: the same leaf loop (without the option, the leaves but
// the last under set_requires_gradient_sync(false)), AdamW over the shards,
// clipping by FullyShard::clip_grad_norm (without: ShardedGradNorm). A
// resume loads parameters, buffers and AdamW state resharded, as the
// Trainer's FSDP checkpoints do (dcp::get_state_dict, dcp::load,
// dcp::set_state_dict into a fresh model and optimizer).
template <typename Holder>
std::vector<std::vector<torch::Tensor>> train_fsdp(int world, int64_t leaves, bool deterministic,
                                                   const Data& data, const Checkpoint& from,
                                                   const FsdpRun& run) {
  std::vector<std::vector<torch::Tensor>> got(world);
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    Holder model;
    load_model(*model, from);
    FullyShardOptions options;
    if (deterministic) {
      options.determinism = Determinism::WorldSizeInvariant;
      options.leaves = leaves;
    }
    auto root = wrap(model, comm, options);
    torch::optim::AdamW opt(root->parameters(),
                            torch::optim::AdamWOptions(0.01).weight_decay(0.01));
    if (!run.load.empty()) {
      auto sd = dcp::get_state_dict(root, opt);
      dcp::load(sd, run.load, *comm);
      dcp::set_state_dict(root, opt, sd);
    }
    ShardedGradNorm sharded(comm);
    const int64_t local = leaves / world;
    const int64_t first = local * comm->rank();
    for (int s = run.begin; s < run.end; ++s) {
      opt.zero_grad();
      for (int64_t l = first; l < first + local; ++l) {
        auto x = data.xs[s][l].clone();
        auto y = data.ys[s][l].clone();
        const double scale = deterministic ? 1.0 : static_cast<double>(local);
        if (!deterministic) root->set_requires_gradient_sync(l + 1 == first + local);
        (torch::mse_loss(root->forward(x), y) / scale).backward();
      }
      constexpr double kMaxNorm = 0.05;
      if (deterministic) {
        root->clip_grad_norm(kMaxNorm);
      } else {
        clip_grad_norm(root->parameters(), sharded.global_norm(root->parameters()), kMaxNorm);
      }
      opt.step();
    }
    if (!run.save.empty()) dcp::save(dcp::get_state_dict(root, opt), run.save, *comm);
    root->unshard();  // the module's own tensors hold the full values
    got[comm->rank()] = all_state(*model);
    root->reshard();
  });
  return got;
}

template <typename Holder>
void check_model(Mode mode, bool cnn) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  Holder proto;
  const Checkpoint init{all_state(*proto), "", {}};
  const size_t n_params = proto->parameters().size();
  auto params_of = [&](const std::vector<torch::Tensor>& s) {
    return std::vector<torch::Tensor>(s.begin(), s.begin() + static_cast<int64_t>(n_params));
  };
  for (const int64_t leaves : {8, 12}) {
    const auto data = make_data(cnn, leaves);
    const auto reference = train<Holder>(mode, 1, leaves, true, data, init)[0];
    ASSERT_GT(max_abs_diff(params_of(reference), params_of(init.state)), 1e-3)
        << "training moved nothing";
    const std::vector<int> worlds =
        leaves == 8 ? std::vector<int>{2, 4, 8} : std::vector<int>{3, 6};
    for (int world : worlds) {
      const auto got = train<Holder>(mode, world, leaves, true, data, init);
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(same_bytes(got[r], reference))
            << "L " << leaves << " world " << world << " rank " << r << ": largest difference "
            << max_abs_diff(got[r], reference);
      }
    }
    if (leaves == 12) {
      // Elastic resume: 10 steps at world 4, the state saved, 10 at world 3.
      Checkpoint middle;
      train<Holder>(mode, 4, leaves, true, data, init, 0, kSteps / 2, &middle);
      const auto resumed = train<Holder>(mode, 3, leaves, true, data, middle, kSteps / 2, kSteps);
      for (int r = 0; r < 3; ++r) {
        EXPECT_TRUE(same_bytes(resumed[r], reference))
            << "resumed 4 -> 3, rank " << r << ": largest difference "
            << max_abs_diff(resumed[r], reference);
      }
      continue;
    }
    // Negative control: the usual reduction order is not world-size invariant.
    const auto plain1 = train<Holder>(mode, 1, leaves, false, data, init)[0];
    const auto plain4 = train<Holder>(mode, 4, leaves, false, data, init)[0];
    const double off = max_abs_diff(params_of(plain1), params_of(plain4));
    std::cout << (mode == Mode::Ddp ? "ddp " : "zero-2 ") << (cnn ? "cnn" : "transformer")
              << ": without the option, world 1 and world 4 differ by " << off
              << " (largest parameter difference after " << kSteps << " steps)\n";
    EXPECT_FALSE(same_bytes(params_of(plain1), params_of(plain4)));
    if (mode != Mode::Ddp) continue;
    // The canonical mean is the same mean, in another order: one step lands
    // where plain DDP's does, to rounding (20 steps of AdamW magnify rounding
    // to ~1e-3, as between worlds 1 and 4 above).
    const auto det_one = train<Holder>(mode, 1, leaves, true, data, init, 0, 1)[0];
    const auto plain_one = train<Holder>(mode, 1, leaves, false, data, init, 0, 1)[0];
    EXPECT_LT(max_abs_diff(params_of(det_one), params_of(plain_one)), 1e-6);
    EXPECT_GT(max_abs_diff(params_of(det_one), params_of(init.state)), 1e-3);
  }
}

// What check_fsdp runs against world 1: `worlds`, `steps` steps each.
// `control`: the negative control, world 1 against world 4 without the
// option. `resume`: an elastic resume, steps / 2 at world 4, the state
// saved (dcp), the rest at world 3 (leaves 12).
struct FsdpCheck {
  int64_t leaves = 8;
  std::vector<int> worlds;
  int steps = kSteps;
  bool control = false;
  bool resume = false;
};

template <typename Holder>
void check_fsdp(bool cnn, const FsdpCheck& c) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  Holder proto;
  const Checkpoint init{all_state(*proto), "", {}};
  const size_t n_params = proto->parameters().size();
  auto params_of = [&](const std::vector<torch::Tensor>& s) {
    return std::vector<torch::Tensor>(s.begin(), s.begin() + static_cast<int64_t>(n_params));
  };
  const auto data = make_data(cnn, c.leaves);
  const FsdpRun whole{0, c.steps, "", ""};
  const auto reference = train_fsdp<Holder>(1, c.leaves, true, data, init, whole)[0];
  ASSERT_GT(max_abs_diff(params_of(reference), params_of(init.state)), 1e-3)
      << "training moved nothing";
  for (int world : c.worlds) {
    const auto got = train_fsdp<Holder>(world, c.leaves, true, data, init, whole);
    for (int r = 0; r < world; ++r) {
      EXPECT_TRUE(same_bytes(got[r], reference))
          << "L " << c.leaves << " world " << world << " rank " << r << ": largest difference "
          << max_abs_diff(got[r], reference);
    }
  }
  if (c.resume) {
    const auto dir = std::filesystem::temp_directory_path() /
                     ("cohort_det_" + std::to_string(::getpid()) + (cnn ? "_cnn" : "_tr"));
    std::filesystem::remove_all(dir);
    const int half = c.steps / 2;
    train_fsdp<Holder>(4, c.leaves, true, data, init, {0, half, "", dir.string()});
    const auto resumed =
        train_fsdp<Holder>(3, c.leaves, true, data, init, {half, c.steps, dir.string(), ""});
    std::filesystem::remove_all(dir);
    for (int r = 0; r < 3; ++r) {
      EXPECT_TRUE(same_bytes(resumed[r], reference))
          << "resumed 4 -> 3, rank " << r << ": largest difference "
          << max_abs_diff(resumed[r], reference);
    }
  }
  if (!c.control) return;
  const auto plain1 = train_fsdp<Holder>(1, c.leaves, false, data, init, whole)[0];
  const auto plain4 = train_fsdp<Holder>(4, c.leaves, false, data, init, whole)[0];
  std::cout << "fsdp " << (cnn ? "cnn" : "transformer")
            << ": without the option, world 1 and world 4 differ by "
            << max_abs_diff(params_of(plain1), params_of(plain4))
            << " (largest parameter difference after " << c.steps << " steps)\n";
  EXPECT_FALSE(same_bytes(params_of(plain1), params_of(plain4)));
}

TEST(DdpDeterminism, CnnWithBatchNormBitwiseAtEveryWorld) { check_model<DetCnn>(Mode::Ddp, true); }

TEST(DdpDeterminism, TransformerBitwiseAtEveryWorld) {
  check_model<DetTransformer>(Mode::Ddp, false);
}

TEST(DdpDeterminism, Zero2CnnWithBatchNormBitwiseAtEveryWorld) {
  check_model<DetCnn>(Mode::Zero2, true);
}

TEST(DdpDeterminism, Zero2TransformerBitwiseAtEveryWorld) {
  check_model<DetTransformer>(Mode::Zero2, false);
}

// Both models (the CNN as three units with BatchNorm, the transformer as
// one unit), 20 steps: at worlds 1, 2, 4, 8 with L = 8 (with the negative
// control), at 1, 3, 6 with L = 12 and through an elastic resume 4 -> 3.
TEST(FsdpDeterminism, CnnWithBatchNormBitwiseAtWorlds1248) {
  check_fsdp<DetCnn>(true, {8, {2, 4, 8}, kSteps, true, false});
}

TEST(FsdpDeterminism, CnnWithBatchNormBitwiseAtWorlds136AndThroughResume4To3) {
  check_fsdp<DetCnn>(true, {12, {3, 6}, kSteps, false, true});
}

TEST(FsdpDeterminism, TransformerBitwiseAtWorlds1248) {
  check_fsdp<DetTransformer>(false, {8, {2, 4, 8}, kSteps, true, false});
}

TEST(FsdpDeterminism, TransformerBitwiseAtWorlds136AndThroughResume4To3) {
  check_fsdp<DetTransformer>(false, {12, {3, 6}, kSteps, false, true});
}

TEST(DdpDeterminism, CanonicalNormIsTheSameBitsForEverySlicing) {
  // 10000 elements (blocks 4096, 4096, 1808) cut into the chunks ZeRO-2
  // holds at worlds 2, 3, 5, 7, and into slices of 1000 over 16 ranks (six
  // empty, blocks over five ranks): the same bits as over the whole.
  torch::manual_seed(3);
  const auto v = torch::randn({10000});
  const double whole = canonical_squared_norm(nullptr, v, 0, v.numel());
  EXPECT_NEAR(whole, v.to(torch::kFloat64).square().sum().item<double>(), 1e-9 * whole);
  for (int world : {2, 3, 5, 7, 16}) {
    std::vector<double> got(world);
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      const int64_t chunk = world == 16 ? 1000 : (v.numel() + world - 1) / world;
      const int64_t lo = std::min<int64_t>(v.numel(), chunk * comm->rank());
      const int64_t hi = std::min<int64_t>(v.numel(), lo + chunk);
      got[comm->rank()] =
          canonical_squared_norm(comm.get(), v.narrow(0, lo, hi - lo), lo, v.numel());
    });
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(std::memcmp(&got[r], &whole, sizeof(double)), 0)
          << "world " << world << " rank " << r << ": " << got[r] << " vs " << whole;
    }
  }
}

TEST(DdpDeterminism, CanonicalTreeShape) {
  LeafTree tree(12);
  // Splits at the largest power of two below n: [0,8) [8,12), [0,4) [4,8), ...
  const auto& root = tree.nodes()[0];
  EXPECT_EQ(tree.nodes()[root.left].hi, 8);
  EXPECT_EQ(tree.frontier(0, 4), std::vector<int>{tree.nodes()[root.left].left});
  // Worlds 1, 3, 6 at L = 12: one subtree per rank; world 4: [0,3) is [0,2) + [2,3).
  for (int world : {1, 2, 3, 4, 6, 12}) {
    const int64_t k = 12 / world;
    for (int r = 0; r < world; ++r) {
      const auto f = tree.frontier(k * r, k * (r + 1));
      if (world != 2 && world != 4) {
        EXPECT_EQ(f.size(), 1u) << "world " << world;
      }
      int64_t covered = 0;
      for (int id : f) covered += tree.nodes()[id].hi - tree.nodes()[id].lo;
      EXPECT_EQ(covered, k);
    }
  }
  EXPECT_EQ(tree.frontier(0, 3).size(), 2u);
}

// A model with a parameter no forward uses: its .grad stays undefined.
struct TwoLinearImpl : torch::nn::Module {
  torch::nn::Linear used{nullptr}, unused{nullptr};
  TwoLinearImpl() {
    used = register_module("used", torch::nn::Linear(4, 3));
    unused = register_module("unused", torch::nn::Linear(2, 2));
  }
  torch::Tensor forward(const torch::Tensor& x) { return used(x); }
};
TORCH_MODULE(TwoLinear);

// World 1 divides the mean straight out of the leaves' sum: each .grad is
// the canonical tree of the leaves' gradients over L, bit for bit as one
// process of plain LibTorch computes it (L = 3: (g0 + g1) + g2), for both
// .grad layouts and both float dtypes; the unused parameter's .grad stays
// undefined, as there.
TEST(DdpDeterminism, WorldOneMeanIsTheCanonicalSumOverL) {
  for (const auto dtype : {torch::kFloat, torch::kDouble}) {
    for (const int64_t leaves : {1, 2, 3}) {
      for (const bool bucket_view : {true, false}) {
        SCOPED_TRACE(std::string(c10::toString(dtype)) + " L " + std::to_string(leaves) +
                     (bucket_view ? " bucket view" : " own .grad"));
        torch::manual_seed(7);
        std::vector<torch::Tensor> xs, ys;
        for (int64_t l = 0; l < leaves; ++l) {
          xs.push_back(torch::randn({5, 4}, dtype));
          ys.push_back(torch::randn({5, 3}, dtype));
        }
        TwoLinear reference;
        reference->to(dtype);
        std::vector<std::vector<torch::Tensor>> g;  // per leaf, per parameter
        for (int64_t l = 0; l < leaves; ++l) {
          reference->zero_grad();
          torch::mse_loss(reference->forward(xs[l]), ys[l]).backward();
          g.emplace_back();
          for (const auto& p : reference->parameters()) {
            g.back().push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
          }
        }
        std::vector<torch::Tensor> want;
        for (size_t i = 0; i < g[0].size(); ++i) {
          if (!g[0][i].defined()) {
            want.emplace_back();
            continue;
          }
          auto sum = leaves == 1 ? g[0][i] : g[0][i] + g[1][i];
          if (leaves == 3) sum = sum + g[2][i];
          want.push_back(sum.div(static_cast<double>(leaves)));
        }
        run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
          TwoLinear model;
          model->to(dtype);
          {
            torch::NoGradGuard no_grad;
            for (size_t i = 0; i < model->parameters().size(); ++i) {
              model->parameters()[i].copy_(reference->parameters()[i]);
            }
          }
          DDPOptions options;
          options.determinism = Determinism::WorldSizeInvariant;
          options.leaves = leaves;
          options.gradient_as_bucket_view = bucket_view;
          options.find_unused_parameters = true;
          DistributedDataParallel<TwoLinear> ddp(model, comm, options);
          for (int step = 0; step < 2; ++step) {  // the second reuses every buffer
            for (int64_t l = 0; l < leaves; ++l) {
              torch::mse_loss(ddp.forward(xs[l]), ys[l]).backward();
            }
            std::vector<torch::Tensor> got;
            for (const auto& p : model->parameters()) got.push_back(p.grad());
            EXPECT_TRUE(same_bytes(got, want)) << "step " << step;
          }
        });
      }
    }
  }
}

TEST(DdpDeterminism, RefusesWhatWouldReorderSums) {
  // World 3 does not divide 8 leaves: a clear error on every rank.
  std::vector<std::string> errors(3);
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    DDPOptions options;
    options.determinism = Determinism::WorldSizeInvariant;
    options.leaves = 8;
    try {
      DistributedDataParallel<torch::nn::Sequential> ddp(make_ddp_mlp(), comm, options);
    } catch (const InvalidArgument& e) {
      errors[comm->rank()] = e.what();
    }
  });
  for (int r = 0; r < 3; ++r) {
    EXPECT_NE(errors[r].find("divide the leaf count (8)"), std::string::npos) << errors[r];
    EXPECT_NE(errors[r].find("rank " + std::to_string(r)), std::string::npos) << errors[r];
  }
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    DDPOptions options;
    options.determinism = Determinism::WorldSizeInvariant;
    options.leaves = 4;
    DistributedDataParallel<torch::nn::Sequential> ddp(make_ddp_mlp(), comm, options);
    EXPECT_EQ(ddp.local_leaves(), 2);
    EXPECT_EQ(ddp.first_leaf(), 2 * comm->rank());
    EXPECT_THROW(ddp.register_comm_hook(std::make_shared<AllReduceHook>()), InvalidArgument);
    // ZeRO with another leaf count than DDP's, or without DDP: refused.
    ZeroOptions zo;
    zo.stage = 2;
    zo.determinism = Determinism::WorldSizeInvariant;
    zo.leaves = 8;
    EXPECT_THROW(ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
                     ddp, torch::optim::AdamWOptions(0.01), zo),
                 InvalidArgument);
    EXPECT_THROW(ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
                     ddp.parameters(), comm, torch::optim::AdamWOptions(0.01), zo),
                 InvalidArgument);
    auto guard = ddp.no_sync();
    EXPECT_THROW(ddp.forward(torch::randn({2, 8})), InvalidArgument);
  });
}

}  // namespace
}  // namespace cohort::testing::determinism_test
