// fully_shard against one-process training, ranks as threads: after 10
// steps on rank-dependent slices of one global batch, every parameter of
// the gathered model equals the one-process model's within 1e-6 relative
// (fp32), at world 1 to 4, for AdamW and SGD with momentum, resharding
// after forward or not, shapes that do not divide by the world size, a
// weight tied between the first and the last layer, and accumulation over
// two micro-batches. With COHORT_TEST_DEVICE=cuda the models, the data and
// the reference live on the GPU (fsdp_test_models.h).
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <map>
#include <mutex>

#include "cohort/fsdp/fully_shard.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::golden_test {
namespace {

using namespace fsdp_test;

struct GoldenCase {
  int world;
  Opt opt;
  bool reshard_after_forward;
  int micro_batches;
};

std::string name_of(const ::testing::TestParamInfo<GoldenCase>& info) {
  const auto& c = info.param;
  return "World" + std::to_string(c.world) + (c.opt == Opt::AdamW ? "AdamW" : "SGD") +
         (c.reshard_after_forward ? "Reshard" : "Keep") + std::to_string(c.micro_batches) + "Micro";
}

class Golden : public ::testing::TestWithParam<GoldenCase> {};

TEST_P(Golden, ParametersEqualOneProcess) {
  const auto c = GetParam();
  const auto batches = make_batches(11);
  const auto expected = reference(c.opt, batches);
  std::mutex mu;
  std::map<int, Named> got;
  run_ranks_shared(c.world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    auto bare = make_model(comm, {c.reshard_after_forward, {}});
    // Values set before sharding: each unit shards what its layer holds now,
    // so set them on an unsharded twin and load them.
    auto twin = make_model(nullptr, {});
    init_parameters(*twin, 7);
    auto model = fully_shard(bare, comm, {c.reshard_after_forward, {}});
    Named full;
    for (const auto& p : twin->named_parameters()) full.insert(p.key(), p.value());
    model->load_full_state_dict(full);
    auto optimizer = make_optimizer(c.opt, model->parameters());
    train_steps(model, *optimizer, batches, *comm, c.micro_batches);
    auto state = model->full_state_dict();
    std::lock_guard<std::mutex> lock(mu);
    got[comm->rank()] = state;
  });
  for (const auto& [rank, state] : got) {
    expect_close(state, expected, 1e-6, "rank " + std::to_string(rank));
  }
}

INSTANTIATE_TEST_SUITE_P(
    FSDP, Golden,
    ::testing::Values(GoldenCase{1, Opt::AdamW, true, 1}, GoldenCase{2, Opt::AdamW, true, 1},
                      GoldenCase{3, Opt::AdamW, true, 1}, GoldenCase{4, Opt::AdamW, true, 1},
                      GoldenCase{2, Opt::AdamW, false, 1}, GoldenCase{3, Opt::SGD, true, 1},
                      GoldenCase{4, Opt::SGD, false, 1}, GoldenCase{1, Opt::SGD, true, 2},
                      GoldenCase{2, Opt::AdamW, true, 2}, GoldenCase{3, Opt::SGD, false, 2}),
    name_of);

}  // namespace
}  // namespace cohort::testing::golden_test
