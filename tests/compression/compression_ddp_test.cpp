// Compression inside DistributedDataParallel: DDPOptions::compression with
// kind None, and PowerSGD before its start iteration, leave the gradients
// bitwise those of the default all-reduce; every compressor leaves every
// rank with the same gradients (replicas stay in step).
#include <gtest/gtest.h>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::compression_ddp_test {
namespace {

using compression::CompressionKind;

std::vector<torch::Tensor> grads_after_step(std::shared_ptr<Communicator> comm,
                                            const DDPOptions& options,
                                            const std::vector<torch::Tensor>& init,
                                            int64_t* bytes_sent = nullptr) {
  auto model = make_ddp_mlp();
  copy_parameters(*model, init);
  DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, options);
  const int r = comm->rank();
  torch::mse_loss(ddp.forward(torch::full({4, 8}, 0.1 * (r + 1))), torch::ones({4, 4}) * r)
      .backward();
  std::vector<torch::Tensor> out;
  for (auto& p : ddp.parameters()) out.push_back(p.grad().clone());
  if (bytes_sent) *bytes_sent = ddp.stats().bytes_sent;
  return out;
}

// DDPStats::bytes_sent, counted by the communicator at the engine boundary:
// fp16/bf16 send half of the float32 all-reduce, int8 about a quarter.
TEST(DdpCompression, StatsCountTheCompressedBytes) {
  torch::manual_seed(5);
  const auto init = clone_all(make_ddp_mlp()->parameters());
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    int64_t plain = 0;
    grads_after_step(comm, {}, init, &plain);
    ASSERT_GT(plain, 0);
    for (auto [kind, least_ratio] :
         {std::pair{CompressionKind::Fp16, 1.9}, std::pair{CompressionKind::Bf16, 1.9},
          std::pair{CompressionKind::Int8, 3.5}}) {
      DDPOptions o;
      o.compression.kind = kind;
      int64_t sent = 0;
      grads_after_step(comm, o, init, &sent);
      ASSERT_GT(sent, 0);
      EXPECT_GE(static_cast<double>(plain) / sent, least_ratio)
          << compression::to_string(kind) << ": " << plain << " vs " << sent;
    }
  });
}

TEST(DdpCompression, UncompressedPathIsUnchanged) {
  torch::manual_seed(3);
  const auto init = clone_all(make_ddp_mlp()->parameters());
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    const auto plain = grads_after_step(comm, {}, init);
    DDPOptions none;
    none.compression.kind = CompressionKind::None;
    DDPOptions not_yet;
    not_yet.compression.kind = CompressionKind::PowerSGD;
    not_yet.compression.powersgd_start_iteration = 5;
    for (auto* o : {&none, &not_yet}) {
      const auto g = grads_after_step(comm, *o, init);
      for (size_t i = 0; i < g.size(); ++i) EXPECT_TRUE(torch::equal(g[i], plain[i]));
    }
  });
}

TEST(DdpCompression, EveryCompressorKeepsReplicasIdentical) {
  torch::manual_seed(4);
  const auto init = clone_all(make_ddp_mlp()->parameters());
  for (auto kind : {CompressionKind::Fp16, CompressionKind::Bf16, CompressionKind::Int8,
                    CompressionKind::TopK, CompressionKind::PowerSGD}) {
    run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      DDPOptions o;
      o.compression.kind = kind;
      o.compression.powersgd_start_iteration = 0;  // one step: no state to carry
      o.compression.error_feedback = false;
      o.compression.powersgd_warm_start = false;
      o.compression.powersgd_min_compression_rate = 1;
      const auto exact = grads_after_step(comm, {}, init);
      const auto g = grads_after_step(comm, o, init);
      double largest = 0;  // int8 scales are per chunk of the whole bucket
      for (auto& e : exact) largest = std::max(largest, e.abs().max().item<double>());
      for (size_t i = 0; i < g.size(); ++i) {
        auto all = torch::empty({comm->size(), g[i].numel()});
        comm->all_gather_into_tensor(all, g[i].reshape(-1)).wait();
        for (int r = 0; r < comm->size(); ++r) {
          EXPECT_TRUE(torch::equal(all[r], all[0])) << compression::to_string(kind);
        }
        // Within 1% of the bucket's largest gradient (int8: 1/254 per phase).
        if (kind != CompressionKind::TopK && kind != CompressionKind::PowerSGD) {
          EXPECT_LT((g[i] - exact[i]).abs().max().item<double>(), 0.01 * largest)
              << compression::to_string(kind) << " param " << i;
        }
      }
    });
  }
}

}  // namespace
}  // namespace cohort::testing::compression_ddp_test
