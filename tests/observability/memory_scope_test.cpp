// MemoryScope counts exactly the CPU tensor storage allocated inside it, on
// its thread, wherever and whenever that storage is freed.
#include "cohort/memory/memory_scope.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <thread>

namespace cohort::memory::memory_scope_test {
namespace {

constexpr int64_t kFloat = sizeof(float);

TEST(MemoryScope, CountsCurrentPeakAndTotal) {
  MemoryScope scope;
  EXPECT_EQ(scope.current_bytes(), 0);
  torch::Tensor a = torch::empty({1000});
  {
    torch::Tensor b = torch::empty({250});
    EXPECT_EQ(scope.current_bytes(), 1250 * kFloat);
  }
  EXPECT_EQ(scope.current_bytes(), 1000 * kFloat);
  EXPECT_EQ(scope.peak_bytes(), 1250 * kFloat);
  EXPECT_EQ(scope.allocated_bytes(), 1250 * kFloat);
  scope.reset_peak();
  EXPECT_EQ(scope.peak_bytes(), 1000 * kFloat);
  a = torch::Tensor();
  EXPECT_EQ(scope.current_bytes(), 0);
}

TEST(MemoryScope, EmptyTensorsCostNothing) {
  MemoryScope scope;
  torch::Tensor e = torch::empty({0});
  EXPECT_EQ(scope.current_bytes(), 0);
  EXPECT_EQ(e.numel(), 0);
}

TEST(MemoryScope, NestedScopesCountInEveryEnclosingScope) {
  MemoryScope outer;
  torch::Tensor a = torch::ones({100});
  torch::Tensor kept;
  {
    MemoryScope inner;
    kept = torch::ones({30}, torch::kFloat64);
    EXPECT_EQ(inner.current_bytes(), 30 * 8);
  }
  EXPECT_EQ(outer.current_bytes(), 100 * kFloat + 30 * 8);
  kept = torch::Tensor();  // freed after its scope ended: still uncounted
  EXPECT_EQ(outer.current_bytes(), 100 * kFloat);
}

TEST(MemoryScope, AllocationsOutsideAnyScopeAreNotCounted) {
  torch::Tensor before = torch::empty({500});
  MemoryScope scope;
  torch::Tensor after;
  std::thread([&] { after = torch::empty({700}); }).join();
  EXPECT_EQ(scope.current_bytes(), 0);
  before = torch::Tensor();  // allocated before the scope: no effect
  EXPECT_EQ(scope.current_bytes(), 0);
}

// Ranks as threads: each thread's scope sees its own storage, also when
// another thread frees it after the scope is gone.
TEST(MemoryScope, ThreadsCountTheirOwn) {
  constexpr int kThreads = 3;
  std::vector<torch::Tensor> handed(kThreads);
  std::vector<int64_t> current(kThreads), peak(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      MemoryScope scope;
      handed[t] = torch::zeros({(t + 1) * 1000});
      for (int i = 0; i < 50; ++i) torch::Tensor tmp = torch::rand({(t + 1) * 100});
      current[t] = scope.current_bytes();
      peak[t] = scope.peak_bytes();
    });
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) {
    EXPECT_EQ(current[t], (t + 1) * 1000 * kFloat) << "thread " << t;
    EXPECT_EQ(peak[t], (t + 1) * 1100 * kFloat) << "thread " << t;
  }
  handed.clear();  // frees counters whose scopes have ended
}

TEST(MemoryScope, AutogradSavedTensorsAreCounted) {
  torch::Tensor w = torch::randn({64, 64}, torch::requires_grad());
  torch::Tensor x = torch::randn({8, 64});
  MemoryScope scope;
  torch::Tensor y = torch::tanh(torch::mm(x, w));  // saves tanh's output
  const int64_t held = scope.current_bytes();
  EXPECT_GE(held, 8 * 64 * kFloat);  // y (tanh's saved output is y itself)
  y.sum().backward();
  y = torch::Tensor();
  EXPECT_EQ(scope.current_bytes(), w.grad().numel() * kFloat);  // only w.grad stays
}

}  // namespace
}  // namespace cohort::memory::memory_scope_test
