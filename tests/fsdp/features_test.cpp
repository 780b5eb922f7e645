// fully_shard's features beyond the golden grid, ranks as threads: a unit
// unused on some steps (against one process, world 1 to 4), BatchNorm
// (against one process replaying DDP's rule, world 1 to 4, and against
// cohort DDP: each rank normalizes with its own batch, and rank 0's
// buffers are broadcast before each forward), the full state dict round trip, the collectives of
// one step, what a rank holds between steps and at its peak, and bad input.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/ddp/distributed_data_parallel.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/memory/memory_scope.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::features_test {
namespace {

using namespace fsdp_test;

// A trunk, a side branch used on steps s % 3 != 0 only, and a head held by
// the root. Units when built with a communicator.
struct BranchyImpl : torch::nn::Module {
  AnyModule trunk, side;
  torch::nn::Linear head{nullptr};
  bool use_side = true;
  explicit BranchyImpl(std::shared_ptr<Communicator> comm) {
    auto unit = [&](AnyModule m) { return comm ? AnyModule(FullyShard(m, comm)) : m; };
    trunk = unit(AnyModule(Linear(5, 6)));
    side = unit(AnyModule(Linear(6, 6)));
    register_module("trunk", trunk.ptr());
    register_module("side", side.ptr());
    head = register_module("head", Linear(6, 5));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::tanh(trunk.forward(x));
    if (use_side) h = h + torch::tanh(side.forward(h));
    return head(h);
  }
};
TORCH_MODULE(Branchy);

TEST(FSDPFeatures, UnitUnusedOnSomeStepsEqualsOneProcess) {
  const auto batches = make_batches(3);
  auto ref = Branchy(std::shared_ptr<Communicator>());
  init_parameters(*ref, 5);
  Named expected;
  {
    torch::optim::AdamW opt(ref->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
    for (int s = 0; s < kSteps; ++s) {
      ref->use_side = s % 3 != 0;
      opt.zero_grad();
      torch::mse_loss(ref->forward(batches.x[s]), batches.y[s]).backward();
      opt.step();
    }
    for (const auto& p : ref->named_parameters()) expected.insert(p.key(), p.value().clone());
  }
  for (int world : {1, 2, 3, 4}) {
    std::mutex mu;
    std::vector<Named> got;
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      auto bare = Branchy(comm);
      auto model = fully_shard(AnyModule(bare), comm);
      auto twin = Branchy(std::shared_ptr<Communicator>());
      init_parameters(*twin, 5);
      load_from(model, *twin);
      torch::optim::AdamW opt(model->parameters(),
                              torch::optim::AdamWOptions(1e-2).weight_decay(0.1));
      for (int s = 0; s < kSteps; ++s) {
        bare->use_side = s % 3 != 0;
        opt.zero_grad();
        auto x = local(batches.x[s], *comm), y = local(batches.y[s], *comm);
        torch::mse_loss(model->forward(x), y).backward();
        opt.step();
      }
      auto state = model->full_state_dict();
      std::lock_guard<std::mutex> lock(mu);
      got.push_back(state);
    });
    for (const auto& state : got)
      expect_close(state, expected, 1e-6, "world " + std::to_string(world));
  }
}

torch::nn::Sequential batch_norm_model() {
  return Sequential(Linear(5, 8), torch::nn::BatchNorm1d(8), Tanh(), Linear(8, 5));
}

// The BatchNorm model sharded over `comm`, with the values of seed 9.
FullyShard sharded_batch_norm_model(const std::shared_ptr<Communicator>& comm) {
  auto twin = batch_norm_model();
  init_parameters(*twin, 9);
  auto model = fully_shard(shard_blocks(batch_norm_model(), comm), comm);
  load_from(model, *twin);
  return model;
}

// One process replaying what `world` ranks do under DDP's buffer rule: each
// rank's slice (scaled by 1 + rank, as the ranks' inputs below) normalized
// with its own statistics from rank 0's buffers, the gradient the mean of
// the slices' gradients. Returns each rank's parameters and buffers after
// the last step (a rank's buffers are rank 0's of the step before, updated
// by its own slice: the broadcast comes before the next forward).
std::vector<Named> batch_norm_reference(const Batches& batches, int world) {
  auto model = batch_norm_model();
  init_parameters(*model, 9);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto buffers = [&] {
    std::vector<torch::Tensor> out;
    for (const auto& b : model->buffers()) out.push_back(b.clone());
    return out;
  };
  auto set_buffers = [&](const std::vector<torch::Tensor>& values) {
    torch::NoGradGuard no_grad;
    auto bs = model->buffers();
    for (size_t i = 0; i < bs.size(); ++i) bs[i].copy_(values[i]);
  };
  const int64_t n = kBatch / world;
  std::vector<std::vector<torch::Tensor>> per_rank(world);
  for (int s = 0; s < kSteps; ++s) {
    opt.zero_grad();
    const auto start = buffers();
    for (int r = 0; r < world; ++r) {
      set_buffers(start);
      auto x = batches.x[s].narrow(0, r * n, n) * (1 + r), y = batches.y[s].narrow(0, r * n, n);
      (torch::mse_loss(model->forward(x), y) / world).backward();
      per_rank[r] = buffers();
    }
    set_buffers(per_rank[0]);
    opt.step();
  }
  std::vector<Named> out(world);
  for (int r = 0; r < world; ++r) {
    set_buffers(per_rank[r]);
    for (const auto& p : model->named_parameters()) out[r].insert(p.key(), p.value().clone());
    for (const auto& b : model->named_buffers()) out[r].insert(b.key(), b.value().clone());
  }
  return out;
}

TEST(FSDPFeatures, BatchNormEqualsOneProcess) {
  const auto batches = make_batches(4);
  for (int world : {1, 2, 3, 4}) {
    const auto expected = batch_norm_reference(batches, world);
    std::mutex mu;
    std::map<int, Named> got;
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      auto model = sharded_batch_norm_model(comm);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      for (int s = 0; s < kSteps; ++s) {
        auto x = local(batches.x[s], *comm) * (1 + comm->rank()), y = local(batches.y[s], *comm);
        opt.zero_grad();
        torch::mse_loss(model->forward(x), y).backward();
        opt.step();
      }
      auto state = model->full_state_dict();
      std::lock_guard<std::mutex> lock(mu);
      got[comm->rank()] = state;
    });
    for (const auto& [rank, state] : got)
      expect_close(state, expected[rank], 1e-6,
                   "world " + std::to_string(world) + " rank " + std::to_string(rank));
  }
}

TEST(FSDPFeatures, BatchNormEqualsDDP) {
  const auto batches = make_batches(4);
  for (int world : {2, 3}) {
    std::mutex mu;
    std::map<int, std::pair<Named, Named>> got;  // rank -> (FSDP, DDP)
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      auto model = sharded_batch_norm_model(comm);
      auto twin = batch_norm_model();
      init_parameters(*twin, 9);
      auto plain = batch_norm_model();
      {
        torch::NoGradGuard no_grad;
        for (const auto& p : twin->named_parameters()) {
          plain->named_parameters()[p.key()].copy_(p.value());
        }
      }
      DistributedDataParallel<Sequential> ddp(plain, comm);
      torch::optim::SGD opt_f(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      torch::optim::SGD opt_d(ddp.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
      for (int s = 0; s < kSteps; ++s) {
        auto x = local(batches.x[s], *comm), y = local(batches.y[s], *comm);
        // Rank-dependent inputs: each rank's batch statistics differ.
        x = x * (1 + comm->rank());
        opt_f.zero_grad();
        torch::mse_loss(model->forward(x), y).backward();
        opt_f.step();
        opt_d.zero_grad();
        torch::mse_loss(ddp.forward(x), y).backward();
        opt_d.step();
      }
      Named d;
      for (const auto& p : plain->named_parameters()) d.insert(p.key(), p.value().clone());
      for (const auto& b : plain->named_buffers()) d.insert(b.key(), b.value().clone());
      auto f = model->full_state_dict();
      std::lock_guard<std::mutex> lock(mu);
      got[comm->rank()] = {f, d};
    });
    for (const auto& [rank, pair] : got) {
      expect_close(pair.first, pair.second, 1e-6, "rank " + std::to_string(rank));
    }
  }
}

TEST(FSDPFeatures, FullStateDictLoadsIntoTheBareModelAndBack) {
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    auto twin = make_model(nullptr, {});
    init_parameters(*twin, 21);
    auto model = fully_shard(make_model(comm, {}), comm);
    load_from(model, *twin);
    auto full = model->full_state_dict();
    // The bare model's names, shapes and values.
    auto bare = make_model(nullptr, {});
    ASSERT_EQ(full.size(), bare->named_parameters().size());
    for (const auto& p : twin->named_parameters()) {
      ASSERT_NE(full.find(p.key()), nullptr) << p.key();
      EXPECT_TRUE(torch::equal(full[p.key()], p.value())) << p.key();
    }
    // A missing key is named, and nothing is loaded.
    Named partial;
    for (const auto& e : full) {
      if (e.key() != "2.weight") partial.insert(e.key(), e.value() + 1);
    }
    try {
      model->load_full_state_dict(partial);
      ADD_FAILURE() << "a missing key was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'2.weight' is missing"), std::string::npos) << e.what();
    }
    auto after = model->full_state_dict();
    for (const auto& e : full) EXPECT_TRUE(torch::equal(after[e.key()], e.value())) << e.key();
  });
}

// As PyTorch's load_state_dict(strict=True): a key the model does not have
// (a misspelt name, another model's tensor) is named on every rank, and
// nothing is loaded, at worlds 1 and 3.
TEST(FSDPFeatures, LoadFullStateDictRefusesUnexpectedKeys) {
  for (int world : {1, 3}) {
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      auto model = fully_shard(make_model(comm, {}), comm);
      const auto full = model->full_state_dict();
      Named extra;
      for (const auto& e : full) extra.insert(e.key(), e.value() + 1);
      extra.insert("2.wieght", full["2.weight"] + 1);
      try {
        model->load_full_state_dict(extra);
        ADD_FAILURE() << "an unexpected key was accepted";
      } catch (const InvalidArgument& e) {
        EXPECT_NE(std::string(e.what()).find("unexpected keys, not the model's: '2.wieght'"),
                  std::string::npos)
            << e.what();
      }
      auto after = model->full_state_dict();
      for (const auto& e : full) EXPECT_TRUE(torch::equal(after[e.key()], e.value())) << e.key();
    });
  }
}

uint64_t calls(const Communicator& comm, OpKind kind) {
  return comm.stats().ops[static_cast<size_t>(kind)].calls;
}

TEST(FSDPFeatures, CollectivesPerStepAreOneAllGatherPerUnitAndPassAndOneReduceScatterPerUnit) {
  // Units: the root (tied weight, last Linear) and two Linear layers.
  constexpr uint64_t kUnits = 3, kSteps3 = 3;
  for (bool reshard : {true, false}) {
    run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
      auto model = fully_shard(make_model(comm, {reshard, {}}), comm);
      torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
      comm->reset_stats();
      for (uint64_t s = 0; s < kSteps3; ++s) {
        opt.zero_grad();
        model->forward(torch::randn({4, 5})).square().mean().backward();
        opt.step();
      }
      // Forward gathers every unit; backward gathers again the units that
      // resharded after forward (all but the root). Each collective of the
      // schedule (the gathers, the reduce-scatters, the end of backward's
      // all-reduce) is preceded by the ranks' check that they issue the
      // same one: an all-gather of a few words.
      const uint64_t gathers = kUnits + (reshard ? kUnits - 1 : 0);
      const uint64_t checks = gathers + kUnits + 1;
      EXPECT_EQ(calls(*comm, OpKind::AllGatherIntoTensor), kSteps3 * (gathers + checks)) << reshard;
      EXPECT_EQ(calls(*comm, OpKind::ReduceScatterTensor), kSteps3 * kUnits) << reshard;
      // "Does any rank have this gradient?"
      EXPECT_EQ(calls(*comm, OpKind::AllReduce), kSteps3) << reshard;
      EXPECT_EQ(calls(*comm, OpKind::Broadcast) + calls(*comm, OpKind::BroadcastCoalesced), 0u);
    });
  }
}

// Eight equal units of `kWidth` x `kWidth` weights and biases.
constexpr int64_t kWidth = 64, kUnits8 = 8;
constexpr int64_t kUnitBytes = (kWidth * kWidth + kWidth) * 4;

torch::nn::Sequential stack() {
  Sequential seq;
  for (int64_t i = 0; i < kUnits8; ++i) {
    seq->push_back(Linear(kWidth, kWidth));
    seq->push_back(Tanh());
  }
  return seq;
}

TEST(FSDPFeatures, ARankHoldsItsShardsAndAtMostThreeUnitBuffersInForward) {
  for (int world : {2, 4}) {
    run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      auto model = fully_shard(shard_blocks(stack(), comm), comm);
      int64_t held = 0;
      for (const auto& p : model->parameters()) held += p.numel() * 4;
      // Rows divide evenly: exactly 1/N of the model.
      EXPECT_EQ(held, kUnits8 * kUnitBytes / world);
      auto x = torch::randn({4, kWidth});
      int64_t peak = 0;
      {
        torch::NoGradGuard no_grad;
        memory::MemoryScope scope;
        model->forward(x);
        peak = scope.peak_bytes();
      }
      // The unit computing and the next one's all-gather output, plus the
      // engine's staging of that output (c10d's Gloo all-gather gathers into
      // a buffer of its own and copies out), plus the activations (a few rows).
      EXPECT_LE(peak, 3 * kUnitBytes + 16 * 4 * kWidth * 4) << "world " << world;
      EXPECT_GE(peak, kUnitBytes) << "world " << world;  // it did gather
      // Between steps nothing full is left.
      model->forward(x).sum().backward();
      for (const auto& m : model->modules()) {
        if (auto* unit = dynamic_cast<FullyShardImpl*>(m.get()); unit && unit->has_param_group()) {
          EXPECT_EQ(unit->param_group().unsharded_bytes(), 0);
        }
      }
    });
  }
}

// The collectives on cohort's own ring: it gathers straight into FSDP's
// buffer, where c10d's Gloo all-gather stages the output in a buffer of its
// own, allocated on the rank's thread and freed by Gloo's worker whenever it
// drops its reference: a count that depends on timing.
ThreadRanksOptions ring_options() {
  ThreadRanksOptions options;
  options.algorithm = Algorithm::Ring;
  return options;
}

TEST(FSDPFeatures, ABackwardHoldsAtMostTwoUnitsBeyondItsShards) {
  // A unit's backward holds its full parameters and its full gradients;
  // once they have all landed the parameters go, the gradients move into
  // the reduce-scatter input, and only then is the next unit's all-gather
  // output allocated: two units at any time (unit = the padded flat
  // buffer), plus the reduce-scatter's output (a shard), the last weight
  // gradient to land (autograd holds it until its accumulator's hooks
  // return, and the prefetch starts in one) and the gradients of a few
  // activation rows. Counted on the rank's thread over
  // the backward alone (the activations were made by the forward), on the
  // second step (the sharded gradients exist, so the result of each
  // reduce-scatter is added into them). Holding a unit's parameters while
  // the next unit gathers makes it three units.
  constexpr int64_t kBatch = 1;
  for (int world : {1, 2, 3, 4}) {
    run_ranks_shared(
        world,
        [&](std::shared_ptr<Communicator> comm) {
          torch::set_num_threads(1);
          auto model = fully_shard(shard_blocks(stack(), comm), comm);
          auto x = torch::randn({kBatch, kWidth});
          model->forward(x).sum().backward();
          auto loss = model->forward(x).sum();
          int64_t peak = 0;
          {
            memory::MemoryScope scope;
            loss.backward();
            peak = scope.peak_bytes();
          }
          const int64_t rows = (kWidth + world - 1) / world;  // per rank, padded
          const int64_t shard = rows * (kWidth + 1) * 4;      // weight rows + bias rows
          const int64_t unit = world * shard;
          const int64_t activation_grads = 4 * kBatch * kWidth * 4;
          const int64_t landing = kWidth * kWidth * 4;
          EXPECT_LE(peak, 2 * unit + shard + landing + activation_grads) << "world " << world;
          EXPECT_GE(peak, 2 * kUnitBytes) << "world " << world;  // it did gather
        },
        ring_options());
  }
}

TEST(FSDPErrors, WrappingTwiceIsRefused) {
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto lin = Linear(3, 3);
    auto unit = FullyShard(AnyModule(lin), comm);
    EXPECT_THROW(FullyShard(AnyModule(lin), comm), InvalidArgument);
    EXPECT_THROW(FullyShard(AnyModule(unit), comm), InvalidArgument);
  });
}

TEST(FSDPErrors, RanksWithDifferentShapesFailOnEveryRank) {
  const auto errors = errors_on_every_rank(3, [](std::shared_ptr<Communicator> comm) {
    FullyShard(AnyModule(Linear(3, comm->rank() == 2 ? 4 : 3)), comm);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("fully_shard"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 2"), std::string::npos) << e;
  }
}

TEST(FSDPErrors, AWeightTiedAcrossAUnitBoundaryIsRefused) {
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto w = torch::zeros({5, 7});
    Sequential seq(InProj(w), Tanh(), FullyShard(AnyModule(OutProj(w)), comm));
    try {
      fully_shard(seq, comm);
      ADD_FAILURE() << "a weight shared with an inner unit was accepted";
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("'0.w'"), std::string::npos) << e.what();
    }
  });
}

TEST(FSDPErrors, BackwardAfterANoGradForwardFailsAndTheNextStepWorks) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = fully_shard(make_model(comm, {}), comm);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    torch::Tensor out;
    {
      torch::NoGradGuard no_grad;
      out = model->forward(torch::randn({4, 5}));
    }
    EXPECT_THROW(out.sum().backward(), c10::Error);
    opt.zero_grad();
    model->forward(torch::randn({4, 5})).sum().backward();
    opt.step();
    for (const auto& p : model->parameters()) EXPECT_TRUE(p.grad().defined());
  });
}

}  // namespace
}  // namespace cohort::testing::features_test
