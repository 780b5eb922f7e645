// FSDP × TP (2-D, as torchtitan composes them): each rank's tensor-parallel
// shards are fully sharded over its data-parallel group of a DeviceMesh.
// After 10 AdamW steps on the DP ranks' slices of one global batch, every
// rank's gathered shard equals the matching slice of the one-process model
// (tp = dp = 1, same seeds) within 1e-6 relative (fp32), at dp × tp = 1×1,
// 1×2, 2×2, 3×2 (rows that do not divide by dp) and 3×1, resharding after
// forward or not. The TP layers run without sequence parallelism: their
// replicated parameters then get equal gradients on every TP rank, so the
// DP reduce-scatter is the only reduction they need.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"
#include "tests/fsdp/fsdp_tp_model.h"

namespace cohort::testing::fsdp_tp_test {
namespace {

using namespace fsdp_test;
using namespace fsdp_tp;

Batches make_tp_batches() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  Batches b;
  for (int s = 0; s < kSteps; ++s) {
    b.x.push_back(torch::randn({kBatch, kWidth}, gen));
    b.y.push_back(torch::randn({kBatch, kWidth}, gen));
  }
  return b;
}

Named train_reference(const Batches& b) {
  Named out;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> comm) {
    auto model = make_tp_model(comm, nullptr, {});
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      torch::mse_loss(model->forward(b.x[s]), b.y[s]).backward();
      opt.step();
    }
    for (const auto& p : model->named_parameters()) out.insert(p.key(), p.value().detach().clone());
  });
  return out;
}

struct Case {
  int dp, tp;
  bool reshard_after_forward;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << "dp " << c.dp << " x tp " << c.tp << (c.reshard_after_forward ? ", reshard" : ", keep");
}

class FsdpTp : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpTp, ShardsEqualOneProcessSlices) {
  const auto c = GetParam();
  const auto batches = make_tp_batches();
  const auto expected = train_reference(batches);
  std::mutex mu;
  std::map<int, std::pair<int, Named>> got;  // world rank -> (tp rank, gathered shards)
  run_ranks_shared(c.dp * c.tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {c.dp, c.tp}, {"dp", "tp"});
    const auto dp_group = mesh["dp"].process_group();
    const FullyShardOptions options{c.reshard_after_forward, {}};
    auto model = fully_shard(make_tp_model(mesh["tp"].process_group(), dp_group, options), dp_group,
                             options);
    torch::optim::AdamW opt(model->parameters(), torch::optim::AdamWOptions(1e-2));
    for (int s = 0; s < kSteps; ++s) {
      opt.zero_grad();
      auto x = local(batches.x[s], *dp_group), y = local(batches.y[s], *dp_group);
      torch::mse_loss(model->forward(x), y).backward();
      opt.step();
    }
    auto state = model->full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    got[world->rank()] = {mesh.local_rank("tp"), state};
  });
  ASSERT_EQ(got.size(), static_cast<size_t>(c.dp * c.tp));
  for (const auto& [rank, entry] : got) {
    const auto& [t, state] = entry;
    Named want;
    for (const auto& e : expected) want.insert(e.key(), tp_slice(e.key(), e.value(), t, c.tp));
    expect_close(state, want, 1e-6, "rank " + std::to_string(rank));
  }
}

INSTANTIATE_TEST_SUITE_P(FSDP, FsdpTp,
                         ::testing::Values(Case{1, 1, true}, Case{1, 2, true}, Case{2, 2, true},
                                           Case{2, 2, false}, Case{3, 2, true}, Case{3, 1, false}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return "Dp" + std::to_string(info.param.dp) + "Tp" +
                                  std::to_string(info.param.tp) +
                                  (info.param.reshard_after_forward ? "Reshard" : "Keep");
                         });

}  // namespace
}  // namespace cohort::testing::fsdp_tp_test
