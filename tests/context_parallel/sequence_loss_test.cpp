// sequence_mean_loss against its closed form on 3 ranks that count 0, 2 and
// 4 tokens: every rank's value is Σ counted losses / 6, its gradient cp / 6
// on its counted tokens and 0 elsewhere (so the average over the ranks,
// what GradientSynchronizer takes, is 1 / 6); no rank counting a token is
// NaN, as LibTorch's mean; a rank whose mask does not fit is an
// InvalidArgument on every rank, naming it.
#include "cohort/context_parallel/sequence_loss.h"

#include <gtest/gtest.h>

#include <cmath>
#include <mutex>

#include "support/rank_errors.h"
#include "support/thread_ranks.h"

namespace cohort::testing::sequence_loss_test {
namespace {

using context_parallel::sequence_mean_loss;

constexpr int kRanks = 3;

// Rank r's per-token losses, [2, 3]: 10r + 1 .. 10r + 6; the ignored ones
// are large, so counting one would show.
torch::Tensor losses_of(int r) {
  auto l = torch::arange(1, 7, torch::kFloat64).reshape({2, 3}) + 10.0 * r;
  return l.requires_grad_();
}

// Rank 0 counts none, rank 1 its first row's first two, rank 2 all but its
// last two.
torch::Tensor counted_of(int r) {
  auto c = torch::zeros({2, 3}, torch::kBool);
  if (r == 1) c[0].narrow(0, 0, 2).fill_(true);
  if (r == 2) c.view({-1}).narrow(0, 0, 4).fill_(true);
  return c;
}

TEST(SequenceMeanLoss, ClosedForm) {
  // Counted: 11, 12 (rank 1); 21, 22, 23, 24 (rank 2).
  const double want = (11 + 12 + 21 + 22 + 23 + 24) / 6.0;
  std::mutex mu;
  std::vector<double> values(kRanks);
  std::vector<torch::Tensor> grads(kRanks);
  run_ranks_shared(kRanks, [&](std::shared_ptr<Communicator> g) {
    auto l = losses_of(g->rank());
    auto loss = sequence_mean_loss(l, counted_of(g->rank()), *g);
    loss.backward();
    std::lock_guard<std::mutex> lock(mu);
    values[g->rank()] = loss.item<double>();
    grads[g->rank()] = l.grad().clone();
  });
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_NEAR(values[r], want, 1e-12) << "rank " << r;
    auto expected = counted_of(r).to(torch::kFloat64) * (kRanks / 6.0);
    EXPECT_TRUE(torch::allclose(grads[r], expected, 0, 1e-12)) << "rank " << r << grads[r];
  }
}

TEST(SequenceMeanLoss, NoTokenCountedIsNaN) {
  std::mutex mu;
  std::vector<double> values(2);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> g) {
    auto loss = sequence_mean_loss(losses_of(g->rank()), counted_of(0), *g);
    std::lock_guard<std::mutex> lock(mu);
    values[g->rank()] = loss.item<double>();
  });
  for (double v : values) EXPECT_TRUE(std::isnan(v)) << v;
}

TEST(SequenceMeanLoss, MaskOfAnotherShapeIsNamedOnEveryRank) {
  auto errors = errors_on_every_rank(kRanks, [](std::shared_ptr<Communicator> g) {
    auto counted = counted_of(g->rank());
    if (g->rank() == 1) counted = counted.view({-1});
    sequence_mean_loss(losses_of(g->rank()), counted, *g);
  });
  for (int r = 0; r < kRanks; ++r) {
    const auto& e = errors[static_cast<size_t>(r)];
    EXPECT_NE(e.find("sequence_mean_loss on rank " + std::to_string(r) + " of 3"),
              std::string::npos)
        << e;
    EXPECT_NE(e.find("rank(s) 1 passed"), std::string::npos) << e;
  }
  EXPECT_NE(errors[1].find("[2, 3] Double and [6] Bool"), std::string::npos) << errors[1];
}

}  // namespace
}  // namespace cohort::testing::sequence_loss_test
