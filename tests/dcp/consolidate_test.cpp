// cohort-ckpt consolidate: a sharded checkpoint (FSDP world 3, ZeRO-2 world
// 2, a pipeline's stages at pp 2) becomes one file that torch::load reads
// into the bare model, which then gives the sharded model's outputs.
#include <mutex>

#include "ckpt_files.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "cohort/optim/zero_redundancy_optimizer.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::consolidate_test {
namespace {

namespace fs = std::filesystem;

TEST(Consolidate, FsdpWorld3LoadsWithTorchLoadAndGivesTheSameOutputs) {
  const auto dir = temp_dir("consolidate_fsdp");
  const auto out = (dir / "model.pt").string();
  const auto x = batch(7, 9);
  torch::Tensor sharded_out;
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> comm) {
    auto model = fully_shard(shard_blocks(make_seq(1), comm), comm);
    torch::optim::AdamW opt(model->parameters(), kAdamW);
    for (int s = 0; s < 2; ++s) {
      opt.zero_grad();
      model->forward(batch(100 + s, 9)).pow(2).mean().backward();
      opt.step();
    }
    dcp::save(dcp::get_state_dict(*model, opt), dir, *comm);
    torch::NoGradGuard no_grad;
    auto y = model->forward(x);
    if (comm->rank() == 0) sharded_out = y;
  });
  EXPECT_EQ(cohort_ckpt::consolidate_checkpoint(dir.string(), out), 6);
  auto bare = make_seq(2);
  torch::load(bare, out);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(bare->forward(x), sharded_out));
  fs::remove_all(dir);
}

TEST(Consolidate, ZeroWorld2LoadsWithTorchLoadIntoNestedModules) {
  const auto dir = temp_dir("consolidate_zero");
  const auto out = (dir / "model.pt").string();
  const auto x = batch(8);
  torch::Tensor trained_out;
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> comm) {
    Net net(1, false);
    ZeroOptions zo;
    zo.stage = 2;
    auto zero =
        ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm, kAdamW, zo);
    train(net, 2, [&] { zero->step(); });
    dcp::save(dcp::get_state_dict(*net, *zero), dir, *comm);
    torch::NoGradGuard no_grad;
    if (comm->rank() == 0) trained_out = net->forward(x);
  });
  EXPECT_EQ(cohort_ckpt::consolidate_checkpoint(dir.string(), out), 7);  // 6 parameters, 1 buffer
  Net bare(2, false);
  torch::load(bare, out);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(bare->forward(x), trained_out));
  const auto text = cohort_ckpt::inspect_checkpoint(dir.string(), true);
  EXPECT_NE(text.find("optim.a.weight.exp_avg  float32 [7, 5]"), std::string::npos) << text;
  EXPECT_NE(text.find("every chunk's checksums verified"), std::string::npos) << text;
  fs::remove_all(dir);
}

// A pipeline's checkpoint (pp 2, each rank's stage under the whole model's
// names, as the mesh wiring saves it): the second stage holds the Tanh at
// index 3, which has no parameters, so only that rank knows the module.
// consolidate writes an archive for every rank's modules, and torch::load
// reads the file into the whole model, equal to the bit.
TEST(Consolidate, PipelineStagesLoadWithTorchLoadIntoTheWholeModel) {
  const auto dir = temp_dir("consolidate_pp");
  const auto out = (dir / "model.pt").string();
  auto full = make_seq(1);
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {2, 1, 1}, {"pp", "dp", "tp"});
    auto stage = std::make_shared<torch::nn::Module>("Stage");
    const auto children = full->named_children();
    for (size_t i = 0; i < children.size(); ++i) {
      if ((i >= 2) == (mesh.local_rank("pp") == 1)) {
        stage->register_module(children[i].key(), children[i].value());
      }
    }
    dcp::save(dcp::get_state_dict(*stage, {&mesh, {}}), dir, *world);
  });
  EXPECT_EQ(cohort_ckpt::consolidate_checkpoint(dir.string(), out), 6);
  auto bare = make_seq(2);
  torch::load(bare, out);
  const auto want = full->named_parameters();
  for (const auto& p : bare->named_parameters()) {
    EXPECT_TRUE(torch::equal(p.value(), want[p.key()])) << p.key();
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cohort::testing::dcp_test::consolidate_test
