// The compression hooks run on a worker thread: a bucket's Work is returned
// before its collective finishes (so it overlaps backward), the results are
// bitwise those of the compressor called by hand, bucket by bucket, on the
// caller's thread, and an error on the worker surfaces from wait() naming
// the hook, the bucket, the rank and the peer.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::compression_overlap_test {
namespace {

using compression::CompressionKind;

// Each rank's local gradients averaged with a compressor called by hand on
// this thread, bucket by bucket in `layout`, keyed by bucket index.
void reduce_by_hand(Communicator& comm, compression::Compressor& c,
                    const std::vector<std::vector<size_t>>& layout,
                    std::vector<torch::Tensor>& grads) {
  for (size_t b = 0; b < layout.size(); ++b) {
    std::vector<torch::Tensor> parts;
    for (size_t i : layout[b]) parts.push_back(grads[i].reshape(-1));
    auto flat = torch::cat(parts);
    std::vector<torch::Tensor> shaped;
    int64_t offset = 0;
    for (size_t i : layout[b]) {
      shaped.push_back(flat.narrow(0, offset, grads[i].numel()).view(grads[i].sizes()));
      offset += grads[i].numel();
    }
    c.all_reduce(comm, flat, static_cast<int64_t>(b), shaped);
    for (size_t k = 0; k < layout[b].size(); ++k) grads[layout[b][k]] = shaped[k].clone();
  }
}

class OverlappedHook : public ::testing::TestWithParam<int> {};

TEST_P(OverlappedHook, BitwiseTheCompressorCalledByHand) {
  torch::manual_seed(6);
  const auto init = clone_all(make_ddp_mlp()->parameters());
  for (auto kind : {CompressionKind::Fp16, CompressionKind::Int8, CompressionKind::TopK,
                    CompressionKind::PowerSGD}) {
    run_ranks_shared(GetParam(), [&](std::shared_ptr<Communicator> comm) {
      torch::set_num_threads(1);
      DDPOptions o;
      o.compression.kind = kind;
      o.compression.topk_ratio = 0.2;
      o.compression.powersgd_start_iteration = 2;
      o.compression.powersgd_min_compression_rate = 1;
      o.bucket_cap_mb = o.first_bucket_mb = 300.0 / (1 << 20);  // three buckets
      auto model = make_ddp_mlp(), reference = make_ddp_mlp();
      copy_parameters(*model, init);
      copy_parameters(*reference, init);
      DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, o);
      auto by_hand = compression::make_compressor(o.compression);
      // Four steps: PowerSGD compresses from the third, and the fourth reads
      // the error feedback and Q of the third.
      for (int step = 0; step < 4; ++step) {
        const auto x = torch::full({4, 8}, 0.1 * (comm->rank() + 1) + step);
        const auto y = torch::ones({4, 4}) * comm->rank();
        model->zero_grad();
        torch::mse_loss(ddp.forward(x), y).backward();
        const auto layout = ddp.reducer().bucket_layout();
        ASSERT_EQ(layout.size(), 3u);
        reference->zero_grad();
        torch::mse_loss(reference->forward(x), y).backward();
        std::vector<torch::Tensor> expected;
        for (auto& p : reference->parameters()) expected.push_back(p.grad().clone());
        reduce_by_hand(*comm, *by_hand, layout, expected);
        auto params = model->parameters();
        for (size_t i = 0; i < params.size(); ++i) {
          EXPECT_TRUE(torch::equal(params[i].grad(), expected[i]))
              << compression::to_string(kind) << " step " << step << " param " << i;
        }
      }
    });
  }
}

INSTANTIATE_TEST_SUITE_P(Compression, OverlappedHook, ::testing::Values(1, 3));

GradBucket bucket_of(torch::Tensor buffer) {
  GradBucket b;
  b.buffer = buffer;
  b.gradients = {buffer};
  return b;
}

// Rank 1 starts its bucket only after rank 0's run() returned: a hook that
// reduced on the caller's thread would block rank 0 until its timeout.
TEST(OverlappedHook, RunReturnsBeforeThePeersArrive) {
  std::atomic<bool> rank0_returned{false};
  ThreadRanksOptions options;
  options.timeout = std::chrono::seconds(5);
  run_ranks(
      2,
      [&](Communicator& comm) {
        torch::set_num_threads(1);
        compression::CompressionOptions c;
        c.kind = CompressionKind::Int8;
        CompressionHook hook(c);
        auto buffer = torch::full({100}, 1.0f + comm.rank());
        auto bucket = bucket_of(buffer);
        if (comm.rank() == 1) {
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(5);
          while (!rank0_returned && std::chrono::steady_clock::now() < give_up) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          ASSERT_TRUE(rank0_returned) << "rank 0's run() did not return without its peer";
        }
        Work work = hook.run(comm, bucket);
        if (comm.rank() == 0) {
          EXPECT_FALSE(work.is_completed());
          rank0_returned = true;
        }
        work.wait();
        // (1 + 2) / 2, exact in int8 with one scale per chunk of equal values.
        EXPECT_TRUE(torch::equal(buffer, torch::full({100}, 1.5f)));
      },
      options);
}

// Rank 1 never runs its bucket: rank 0's wait() fails with the hook, the
// bucket, the rank and the peer, and the hook refuses later buckets.
TEST(OverlappedHook, WorkerErrorSurfacesFromWait) {
  std::atomic<bool> rank0_done{false};
  ThreadRanksOptions options;
  // Also the connect's timeout: seconds, so that a loaded machine still
  // connects the two ranks in time.
  options.timeout = std::chrono::seconds(3);
  run_ranks(
      2,
      [&](Communicator& comm) {
        torch::set_num_threads(1);
        if (comm.rank() == 1) {
          // Keep the connections open until rank 0 has seen its timeout.
          const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
          while (!rank0_done && std::chrono::steady_clock::now() < give_up) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
          }
          return;
        }
        Fp16CompressHook hook;
        auto bucket = bucket_of(torch::ones({64}));
        bucket.index = 3;
        Work work = hook.run(comm, bucket);
        try {
          work.wait();
          ADD_FAILURE() << "wait() returned without its peer";
        } catch (const Error& e) {
          const std::string what = e.what();
          EXPECT_NE(what.find("fp16_compress hook (bucket 3) on rank 0 of 2"), std::string::npos)
              << what;
          EXPECT_NE(what.find("peer 1"), std::string::npos) << what;
        }
        auto later = bucket_of(torch::ones({64}));
        EXPECT_THROW(hook.run(comm, later).wait(), PeerError);
        rank0_done = true;
      },
      options);
}

}  // namespace
}  // namespace cohort::testing::compression_overlap_test
