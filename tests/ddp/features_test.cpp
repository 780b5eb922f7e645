// DDP features one by one, ranks as threads: construction (broadcast,
// mismatched models), buffers, no_sync, unused parameters, bucket rebuild,
// gradients as bucket views, synchronize() for SyncStrategy::NoSync, stats,
// and LibTorch's DistributedRandomSampler as the data shard.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <optional>
#include <set>
#include <sstream>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::features_test {
namespace {

using Mlp = torch::nn::Sequential;

TEST(DdpConstruction, BroadcastsRankZerosParameters) {
  torch::set_num_threads(1);
  std::vector<std::vector<torch::Tensor>> got(3);
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_ddp_mlp();
    {
      torch::NoGradGuard g;
      for (auto& p : model->parameters()) p.fill_(comm->rank() + 1);
    }
    DistributedDataParallel<Mlp> ddp(model, comm);
    got[comm->rank()] = clone_all(ddp.parameters());
  });
  for (int r = 0; r < 3; ++r) {
    for (auto& p : got[r]) EXPECT_TRUE(torch::all(p == 1).item<bool>()) << "rank " << r;
  }
}

// A 1-D mesh is its group: the same gradients as over the Communicator;
// a 2-D mesh is refused on every rank, naming it.
TEST(DdpConstruction, TakesAOneDimensionalMesh) {
  torch::set_num_threads(1);
  std::vector<std::vector<torch::Tensor>> by_comm(2), by_mesh(2);
  std::vector<std::string> refused(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    const auto x = torch::full({3, 8}, 0.5 + r), y = torch::full({3, 4}, 1.0 - r);
    auto model = make_ddp_mlp();
    Mlp copy(std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->clone()));
    auto grads = [&](DistributedDataParallel<Mlp>& ddp) {
      torch::nn::functional::mse_loss(ddp.forward(x), y).backward();
      std::vector<torch::Tensor> g;
      for (const auto& p : ddp.parameters()) g.push_back(p.grad().clone());
      return g;
    };
    DistributedDataParallel<Mlp> over_comm(model, comm);
    by_comm[r] = grads(over_comm);
    const auto mesh = init_device_mesh(comm, {2}, {"dp"});
    DistributedDataParallel<Mlp> over_mesh(copy, mesh);
    EXPECT_EQ(over_mesh.process_group(), mesh.process_group());
    by_mesh[r] = grads(over_mesh);
    try {
      DistributedDataParallel<Mlp> ddp(make_ddp_mlp(),
                                       init_device_mesh(comm, {1, 2}, {"pp", "dp"}));
    } catch (const InvalidArgument& e) {
      refused[r] = e.what();
    }
  });
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(by_mesh[r].size(), by_comm[r].size());
    for (size_t i = 0; i < by_comm[r].size(); ++i) {
      EXPECT_TRUE(torch::equal(by_mesh[r][i], by_comm[r][i])) << "rank " << r << ", tensor " << i;
    }
    EXPECT_NE(refused[r].find("the mesh must be 1-D (mesh[\"dp\"]), got pp=1 dp=2"),
              std::string::npos)
        << refused[r];
  }
}

TEST(DdpConstruction, MismatchedShapesNameTheParameterAndRanks) {
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    // Rank 2's second layer is wider.
    const int64_t hidden = comm->rank() == 2 ? 17 : 16;
    auto model = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::Linear(16, hidden));
    try {
      DistributedDataParallel<Mlp> ddp(model, comm);
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("parameter 2 ('1.weight'"), std::string::npos) << m;
      EXPECT_NE(m.find("[16, 16] on rank 0"), std::string::npos) << m;
      EXPECT_NE(m.find("[17, 16] on rank 2"), std::string::npos) << m;
    }
  });
}

TEST(DdpConstruction, MismatchedParameterCountIsNamed) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = torch::nn::Sequential(torch::nn::Linear(8, 16));
    if (comm->rank() == 1) model->push_back(torch::nn::Linear(16, 4));
    try {
      DistributedDataParallel<Mlp> ddp(model, comm);
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const MismatchError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("rank 0 has 2 parameters but rank 1 has 4"), std::string::npos) << m;
    }
  });
}

// Parameters "a" and "b" on the devices given.
struct OnDevicesImpl : torch::nn::Module {
  OnDevicesImpl(torch::Device a, torch::Device b) {
    register_parameter("a", torch::empty({4}, torch::TensorOptions().device(a)));
    register_parameter("b", torch::empty({4}, torch::TensorOptions().device(b)));
  }
};
TORCH_MODULE(OnDevices);

// A bucket is one flat tensor, so a module on two devices is refused by
// name, as is compression (which works on host memory) off the CPU; the
// meta device stands in for a GPU here.
TEST(DdpConstruction, ParametersOnTwoDevicesAndCompressionOffTheCpuAreRefused) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    try {
      DistributedDataParallel<OnDevices> ddp(OnDevices(torch::kCPU, torch::kMeta), comm);
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const InvalidArgument& e) {
      const std::string m = e.what();
      EXPECT_NE(
          m.find("'b' on rank " + std::to_string(comm->rank()) + " is on meta but 'a' on cpu"),
          std::string::npos)
          << m;
    }
    DDPOptions options;
    options.compression.kind = compression::CompressionKind::Fp16;
    try {
      DistributedDataParallel<OnDevices> ddp(OnDevices(torch::kMeta, torch::kMeta), comm, options);
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find("compression on rank " + std::to_string(comm->rank()) +
                                           " takes CPU parameters; these are on meta"),
                std::string::npos)
          << e.what();
    }
  });
}

TEST(DdpBuffers, RebroadcastBeforeForwardUnlessDisabled) {
  for (bool broadcast : {true, false}) {
    run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
      auto model = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
      DDPOptions options;
      options.broadcast_buffers = broadcast;
      DistributedDataParallel<Mlp> ddp(model, comm, options);
      auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(model->ptr(1));
      // Diverge the running mean after construction; eval mode keeps the
      // forward from changing it, so only the broadcast can.
      bn->running_mean.fill_(comm->rank() + 1.0);
      ddp.eval();
      ddp.forward(torch::ones({2, 4}));
      const float expect = broadcast ? 1.0f : comm->rank() + 1.0f;
      EXPECT_TRUE(torch::all(bn->running_mean == expect).item<bool>())
          << "rank " << comm->rank() << " broadcast " << broadcast;
    });
  }
}

// PyTorch's rule, forward by forward: a forward broadcasts the buffers when
// the one before it was a synchronizing training forward (or it is the
// first). Each forward runs in eval mode so that only a broadcast can change
// the running mean, which every rank sets to rank + 1 beforehand.
TEST(DdpBuffers, BroadcastWhenThePreviousForwardSynchronized) {
  struct Forward {
    const char* what;
    bool grad;
    bool no_sync;
    bool broadcasts;
  };
  const std::vector<Forward> sequence = {
      {"first forward", false, false, true},
      {"evaluation after an evaluation", false, false, false},
      {"training after an evaluation", true, false, false},
      {"evaluation after training", false, false, true},
      {"training", true, false, false},
      {"first no_sync micro-batch", true, true, true},
      {"second no_sync micro-batch", true, true, false},
      {"synchronizing micro-batch after no_sync", true, false, false},
      {"training after a synchronizing forward", true, false, true},
  };
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
    DistributedDataParallel<Mlp> ddp(model, comm);
    auto bn = std::dynamic_pointer_cast<torch::nn::BatchNorm1dImpl>(model->ptr(1));
    ddp.eval();
    for (const auto& f : sequence) {
      bn->running_mean.fill_(comm->rank() + 1.0);
      torch::AutoGradMode grad_mode(f.grad);
      std::optional<NoSyncGuard> guard;
      if (f.no_sync) guard.emplace(ddp.no_sync());
      auto out = ddp.forward(torch::ones({2, 4}));
      if (f.grad) out.sum().backward();
      const float expect = f.broadcasts ? 1.0f : comm->rank() + 1.0f;
      EXPECT_TRUE(torch::all(bn->running_mean == expect).item<bool>())
          << f.what << " on rank " << comm->rank();
    }
  });
}

TEST(DdpModuleApi, ForwardsToTheModuleAndSaveLoadKeepsReducing) {
  torch::set_num_threads(1);
  std::vector<std::vector<torch::Tensor>> grads(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
    DistributedDataParallel<Mlp> ddp(model, comm);
    EXPECT_EQ(ddp.named_parameters().keys(), model->named_parameters().keys());
    EXPECT_EQ(ddp.named_buffers().keys(), model->named_buffers().keys());
    EXPECT_EQ(ddp.buffers().size(), 3u);  // running mean, variance, batch count
    ddp.eval();
    EXPECT_FALSE(ddp.is_training() || model->is_training());
    ddp.train();
    EXPECT_TRUE(model->is_training());

    // Saved through DDP, loaded through another DDP: the same state, and
    // gradients are still reduced after the load replaced the tensors.
    std::stringstream bytes;
    torch::serialize::OutputArchive out;
    ddp.save(out);
    out.save_to(bytes);
    auto other = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::BatchNorm1d(3));
    DistributedDataParallel<Mlp> other_ddp(other, comm);
    torch::serialize::InputArchive in;
    in.load_from(bytes);
    other_ddp.load(in);
    EXPECT_EQ(max_abs_diff(other_ddp.parameters(), ddp.parameters()), 0.0);
    other_ddp.forward(torch::full({2, 4}, r + 1.0) * torch::arange(4.0)).pow(2).sum().backward();
    for (auto& p : other_ddp.parameters()) grads[r].push_back(p.grad().clone());
  });
  EXPECT_EQ(max_abs_diff(grads[0], grads[1]), 0.0);
}

// A program written for bare LibTorch modules (two networks, as a GAN has)
// keeps its call sites once each network is wrapped: `->forward`,
// `->zero_grad`, `->parameters`, `torch::save`/`torch::load` on the wrapper,
// with the bare module's names in the file.
TEST(DdpModuleApi, WrappersKeepModuleHolderCallSites) {
  torch::set_num_threads(1);
  const auto dir =
      std::filesystem::temp_directory_path() / ("cohort_ddp_holder_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::vector<std::vector<torch::Tensor>> after(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    torch::manual_seed(0);
    auto g_net =
        torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
    auto d_net =
        torch::nn::Sequential(torch::nn::Linear(3, 5), torch::nn::ReLU(), torch::nn::Linear(5, 1));
    DistributedDataParallel<Mlp> generator(g_net, comm), discriminator(d_net, comm);
    torch::optim::Adam g_opt(generator->parameters(), 1e-2),
        d_opt(discriminator->parameters(), 1e-2);
    for (int step = 0; step < 2; ++step) {
      auto noise = torch::full({4, 4}, r + 1.0) * torch::arange(4.0) / 4;
      discriminator->zero_grad();
      auto fake = generator->forward(noise);
      discriminator->forward(fake.detach()).mean().backward();
      d_opt.step();
      generator->zero_grad();
      (-discriminator->forward(fake).mean()).backward();
      g_opt.step();
    }
    for (auto& p : generator->parameters()) after[r].push_back(p.detach().clone());
    const auto path = (dir / ("generator-" + std::to_string(r) + ".pt")).string();
    torch::save(generator, path);
    auto bare =
        torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
    torch::load(bare, path);  // the wrapper wrote the bare module's names
    EXPECT_EQ(max_abs_diff(bare->parameters(), generator->parameters()), 0.0);
    auto again =
        torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 3));
    DistributedDataParallel<Mlp> reloaded(again, comm);
    torch::load(reloaded, path);
    EXPECT_EQ(max_abs_diff(reloaded->parameters(), generator->parameters()), 0.0);
  });
  std::filesystem::remove_all(dir);
  EXPECT_EQ(max_abs_diff(after[0], after[1]), 0.0);  // the replicas stayed equal
}

TEST(DdpNoSync, AccumulatesLocallyThenReducesTheSum) {
  torch::set_num_threads(1);
  torch::manual_seed(3);
  auto reference = make_ddp_mlp();
  const auto init = clone_all(reference->parameters());
  const auto xs = torch::randn({3, 2, 4, 8});  // micro-step, rank, rows, features
  const auto ys = torch::randn({3, 2, 4, 4});
  // Expected: rank r's local sum over micro-steps while in no_sync; after the
  // synced step, the average over ranks of those sums.
  std::vector<std::vector<torch::Tensor>> local_sum(2), partial_sum(2);
  for (int r = 0; r < 2; ++r) {
    reference->zero_grad();
    for (int m = 0; m < 3; ++m) {
      torch::mse_loss(reference->forward(xs[m][r]), ys[m][r]).backward();
      if (m == 1) {
        for (auto& p : reference->parameters()) partial_sum[r].push_back(p.grad().clone());
      }
    }
    for (auto& p : reference->parameters()) local_sum[r].push_back(p.grad().clone());
  }
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    auto model = make_ddp_mlp();
    copy_parameters(*model, init);
    DistributedDataParallel<Mlp> ddp(model, comm);
    model->zero_grad();
    {
      auto guard = ddp.no_sync();
      for (int m = 0; m < 2; ++m) torch::mse_loss(ddp.forward(xs[m][r]), ys[m][r]).backward();
    }
    // Still local after two no_sync steps: equals this rank's own partial sum.
    auto params = ddp.parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_LT((params[i].grad() - partial_sum[r][i]).abs().max().item<double>(), 1e-6)
          << "rank " << r << ": gradients left the rank under no_sync";
    }
    EXPECT_EQ(ddp.stats().iterations, 0);
    torch::mse_loss(ddp.forward(xs[2][r]), ys[2][r]).backward();
    EXPECT_EQ(ddp.stats().iterations, 1);
    for (size_t i = 0; i < params.size(); ++i) {
      auto expect = (local_sum[0][i] + local_sum[1][i]) / 2;
      EXPECT_LT((params[i].grad() - expect).abs().max().item<double>(), 1e-5) << "rank " << r;
    }
  });
}

}  // namespace
}  // namespace cohort::testing::features_test

namespace cohort::testing::features_test {
namespace {

TEST(DdpNoSyncStrategy, SynchronizeAveragesOnDemand) {
  torch::set_num_threads(1);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = torch::nn::Sequential(torch::nn::Linear(3, 2));
    DDPOptions options;
    options.strategy = SyncStrategy::NoSync;
    DistributedDataParallel<Mlp> ddp(model, comm, options);
    // d(sum(W x + b))/db = rows: rank r feeds r + 1 rows.
    ddp.forward(torch::ones({comm->rank() + 1, 3})).sum().backward();
    auto bias = model->ptr<torch::nn::LinearImpl>(0)->bias;
    EXPECT_TRUE(torch::all(bias.grad() == comm->rank() + 1).item<bool>()) << "reduced too early";
    ddp.reducer().synchronize();
    EXPECT_TRUE(torch::all(bias.grad() == 1.5).item<bool>()) << "rank " << comm->rank();
  });
}

TEST(DdpData, DistributedRandomSamplerGivesDisjointShards) {
  // How a DDP program shards its data: LibTorch's sampler, one per rank,
  // with the communicator's size and rank (see distributed_data_parallel.h).
  constexpr size_t kSize = 10;
  std::vector<std::vector<size_t>> shards(3);
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    torch::data::samplers::DistributedRandomSampler sampler(kSize, comm->size(), comm->rank());
    sampler.set_epoch(1);
    while (auto batch = sampler.next(2)) {
      for (auto i : *batch) shards[comm->rank()].push_back(i);
    }
  });
  std::set<size_t> all;
  for (auto& s : shards) {
    EXPECT_EQ(s.size(), 4u);  // ceil(10 / 3), padded by repeating
    all.insert(s.begin(), s.end());
  }
  EXPECT_EQ(all.size(), kSize);
}

}  // namespace
}  // namespace cohort::testing::features_test
