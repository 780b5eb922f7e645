// What checkpointing saves: a 12-block transformer's peak activation bytes
// (CPU tensor storage allocated during forward and backward, counted by
// MemoryScope; parameters and their gradients are allocated before), with
// and without checkpointing each block.
//
// With fp32 and a block input of I = 4·B·T·H bytes, and S the bytes one
// block's graph keeps after its forward (measured below on one block):
//   without: all 12 graphs are alive when backward starts: peak ≥ 12·S;
//   with:    forward keeps only the 12 block outputs (each the next block's
//            input, the last the loss's), 12·I, and each block's copy of the
//            CPU generator's state, R bytes; backward adds one block at a
//            time: its recompute and backward, at most P1 (the peak of one
//            block's forward and backward alone) plus the incoming
//            gradient, I. So peak ≤ 13·I + 12·R + P1.
// Here (B 4, T 32, H 32, 4 heads, dropout) S ≈ 29·I (the attention
// scores, probabilities and their dropout, T/H times a block input each,
// dominate) and P1 ≈ 1.25·S, so the ratio is about
// (13·I + 12·R + 1.25·S) / (12·S) ≈ 0.15 (measured: 0.14).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "cohort/activation/checkpoint_wrapper.h"
#include "cohort/memory/memory_scope.h"
#include "tests/activation/activation_test_models.h"

namespace cohort::testing::memory_test {
namespace {

constexpr int kBlocks = 12;
constexpr int64_t kBatch = 4, kSeq = 32, kHidden = 32, kHeads = 4;

struct Peak {
  int64_t peak = 0;   // bytes, forward and backward
  int64_t saved = 0;  // bytes alive after forward, less the output
};

// One training step's forward and backward of `net` inside a scope.
Peak measure(torch::nn::Sequential net, const torch::nn::Sequential& params_of) {
  for (auto p : params_of->parameters()) p.mutable_grad() = torch::zeros_like(p);
  auto x = torch::randn({kBatch, kSeq, kHidden}, at::detail::createCPUGenerator(3));
  Peak r;
  {
    memory::MemoryScope scope;
    torch::manual_seed(1);
    auto y = net->forward(x);
    r.saved = scope.current_bytes() - y.nbytes();
    weighted_loss(y).backward();
    r.peak = scope.peak_bytes();
  }
  return r;
}

TEST(CheckpointMemory, TwelveBlocksPeakAtMostAQuarter) {
  torch::set_num_threads(1);  // intra-op workers would allocate off this thread
  auto model = make_transformer(kBlocks, kHidden, kHeads, 0.1);
  auto one = make_transformer(1, kHidden, kHeads, 0.1);
  const int64_t I = 4 * kBatch * kSeq * kHidden;
  const int64_t R = at::detail::getDefaultCPUGenerator().get_state().nbytes();
  const Peak block = measure(one, one);
  const Peak without = measure(model, model);
  const Peak with = measure(checkpoint_blocks(model), model);
  const double ratio = double(with.peak) / double(without.peak);
  RecordProperty("peak_without", std::to_string(without.peak));
  RecordProperty("peak_with", std::to_string(with.peak));
  std::cout << "block input I " << I << ", one block: saved S " << block.saved << ", peak P1 "
            << block.peak << "; 12 blocks: peak without " << without.peak << ", with " << with.peak
            << " (ratio " << ratio << ")\n";
  EXPECT_GE(without.peak, kBlocks * block.saved);
  EXPECT_LE(with.peak, (kBlocks + 1) * I + kBlocks * R + block.peak);
  // The block inputs but x (the caller's), and the RNG states.
  EXPECT_EQ(with.saved, (kBlocks - 1) * I + kBlocks * R);
  EXPECT_LE(ratio, 0.25);
}

}  // namespace
}  // namespace cohort::testing::memory_test
