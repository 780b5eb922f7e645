// Buckets and readiness, ranks as threads: unused parameters (with and
// without find_unused_parameters), the bucket rebuild from the observed
// gradient order, gradients as bucket views, and the per-iteration stats.
#include <gtest/gtest.h>

#include "cohort/ddp/distributed_data_parallel.h"
#include "support/thread_ranks.h"
#include "tests/ddp/ddp_test_models.h"

namespace cohort::testing::buckets_test {
namespace {

std::vector<torch::Tensor> grads_of(torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (auto& p : m.parameters())
    out.push_back(p.grad().defined() ? p.grad().clone() : torch::Tensor());
  return out;
}

TEST(DdpUnused, WithFlagUnusedEverywhereStaysUndefinedAndPartlyUsedIsAveraged) {
  torch::set_num_threads(1);
  torch::manual_seed(5);
  BranchNet reference;
  const auto init = clone_all(reference->parameters());
  const auto x = torch::randn({2, 4, 8});
  const auto y = torch::randn({2, 4, 4});
  // Iteration 2: rank 0 uses the branch, rank 1 skips it.
  std::vector<std::vector<torch::Tensor>> local(2);
  for (int r = 0; r < 2; ++r) {
    reference->zero_grad();
    torch::mse_loss(reference->forward(x[r], /*skip=*/r == 1), y[r]).backward();
    local[r] = grads_of(*reference);
  }
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    BranchNet model;
    copy_parameters(*model, init);
    DDPOptions options;
    options.find_unused_parameters = true;
    options.bucket_cap_mb = 0.0005;
    options.first_bucket_mb = 0.0002;
    DistributedDataParallel<BranchNet> ddp(model, comm, options);
    // Iteration 1: nobody uses the branch.
    torch::mse_loss(ddp.forward(x[r], true), y[r]).backward();
    EXPECT_FALSE(model->branch->weight.grad().defined()) << "unused everywhere must stay undefined";
    EXPECT_TRUE(model->trunk->weight.grad().defined());
    for (auto& p : model->parameters()) p.mutable_grad() = torch::Tensor();
    // Iteration 2: partly used.
    torch::mse_loss(ddp.forward(x[r], r == 1), y[r]).backward();
    auto params = model->parameters();
    auto names = model->named_parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto l0 = local[0][i];
      auto l1 = local[1][i].defined() ? local[1][i] : torch::zeros_like(l0);
      ASSERT_TRUE(params[i].grad().defined()) << names[i].key() << " rank " << r;
      EXPECT_LT((params[i].grad() - (l0 + l1) / 2).abs().max().item<double>(), 1e-6)
          << names[i].key() << " rank " << r;
    }
  });
}

TEST(DdpUnused, WithoutFlagNextForwardNamesTheParameter) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    BranchNet model;
    DistributedDataParallel<BranchNet> ddp(model, comm);
    torch::mse_loss(ddp.forward(torch::ones({2, 8}), true), torch::zeros({2, 4})).backward();
    try {
      ddp.forward(torch::ones({2, 8}), true);
      ADD_FAILURE() << "no error on rank " << comm->rank();
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("'branch.weight'"), std::string::npos) << m;
      EXPECT_NE(m.find("'branch.bias'"), std::string::npos) << m;
      EXPECT_EQ(m.find("'trunk."), std::string::npos) << m;
      EXPECT_NE(m.find("rank " + std::to_string(comm->rank())), std::string::npos) << m;
    }
    // The error is reported once; using every parameter works again.
    torch::mse_loss(ddp.forward(torch::ones({2, 8}), false), torch::zeros({2, 4})).backward();
    EXPECT_EQ(ddp.stats().iterations, 1);
  });
}

// Each parameter in its own bucket, so the layout is the order itself.
DDPOptions one_param_per_bucket() {
  DDPOptions options;
  options.bucket_cap_mb = 1e-6;
  options.first_bucket_mb = 1e-6;
  return options;
}

std::string first_name(GradientReducer& reducer, size_t bucket) {
  return reducer.parameter_names()[reducer.bucket_layout()[bucket].front()];
}

TEST(DdpBuckets, RebuildFollowsTheObservedOrderAndStaysCorrect) {
  torch::set_num_threads(1);
  torch::manual_seed(9);
  BackwardsNet reference;
  const auto init = clone_all(reference->parameters());
  const auto xs = torch::randn({5, 6, 8});
  const auto ys = torch::randn({5, 6, 4});
  torch::optim::SGD opt(reference->parameters(), 0.1);
  for (int s = 0; s < 5; ++s) {
    opt.zero_grad();
    torch::mse_loss(reference->forward(xs[s]), ys[s]).backward();
    opt.step();
  }
  const auto expected = clone_all(reference->parameters());
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    const int r = comm->rank();
    BackwardsNet model;
    copy_parameters(*model, init);
    DistributedDataParallel<BackwardsNet> ddp(model, comm, one_param_per_bucket());
    auto& reducer = ddp.reducer();
    // Reverse registration order: l1 (registered last) comes first.
    EXPECT_EQ(first_name(reducer, 0).substr(0, 2), "l1");
    torch::optim::SGD ropt(ddp.parameters(), 0.1);
    for (int s = 0; s < 5; ++s) {
      ropt.zero_grad();
      torch::mse_loss(ddp.forward(xs[s].narrow(0, 2 * r, 2)), ys[s].narrow(0, 2 * r, 2)).backward();
      ropt.step();
      if (s == 1) {
        EXPECT_TRUE(ddp.stats().buckets_rebuilt);
        // Backward produces l3's gradients first, l1's last.
        EXPECT_EQ(first_name(reducer, 0).substr(0, 2), "l3");
        EXPECT_EQ(first_name(reducer, reducer.bucket_layout().size() - 1).substr(0, 2), "l1");
      }
    }
    EXPECT_LT(max_abs_diff(clone_all(ddp.parameters()), expected), 1e-5) << "rank " << r;
  });
}

TEST(DdpBuckets, GradientsAreViewsIntoTheBuckets) {
  torch::set_num_threads(1);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    BackwardsNet model;
    DDPOptions options;
    options.bucket_cap_mb = 0.0005;
    options.first_bucket_mb = 0.0002;
    options.gradient_as_bucket_view = true;
    DistributedDataParallel<BackwardsNet> ddp(model, comm, options);
    auto& reducer = ddp.reducer();
    for (int step = 0; step < 3; ++step) {  // step 1 rebuilds the buckets
      for (auto& p : model->parameters()) {
        if (p.grad().defined()) p.mutable_grad().zero_();
      }
      ddp.forward(torch::ones({2, 8}) * (comm->rank() + 1)).sum().backward();
      auto layout = reducer.bucket_layout();
      for (size_t b = 0; b < layout.size(); ++b) {
        const auto& buf = reducer.bucket_buffer(b);
        auto* lo = static_cast<char*>(buf.data_ptr());
        auto* hi = lo + buf.nbytes();
        for (size_t i : layout[b]) {
          const auto& g = reducer.parameters()[i].grad();
          auto* p = static_cast<char*>(g.data_ptr());
          EXPECT_TRUE(p >= lo && p + g.nbytes() <= hi)
              << reducer.parameter_names()[i] << " step " << step;
        }
      }
    }
  });
}

TEST(DdpStats, CountBytesBucketsAndShares) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_ddp_mlp();
    DistributedDataParallel<torch::nn::Sequential> ddp(model, comm, one_param_per_bucket());
    int64_t bytes = 0;
    for (auto& p : ddp.parameters()) bytes += p.nbytes();
    for (int s = 0; s < 2; ++s) ddp.forward(torch::ones({2, 8})).sum().backward();
    const auto& st = ddp.stats();
    EXPECT_EQ(st.iterations, 2);
    EXPECT_EQ(st.buckets, 6);
    EXPECT_EQ(st.bytes, bytes);
    EXPECT_GT(st.comm_seconds, 0);
    EXPECT_GE(st.hidden_comm_share, 0);
    EXPECT_LE(st.hidden_comm_share, 1);
    EXPECT_LE(st.hidden_comm_seconds, st.comm_seconds + 1e-12);
  });
}

}  // namespace
}  // namespace cohort::testing::buckets_test
