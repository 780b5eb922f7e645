// Checkpoints of the GPT with experts move between expert- and
// context-parallel meshes exactly: trained two AdamW steps at dp2 x ep2
// (each rank holding two of the four experts of each MoE block), saved with
// dcp::get_state_dict (StateDictOptions::mesh), then loaded at ep1 in one
// process and at cp2 (replicated parameters, the DP-like case) into models of
// other weights and optimizers that have not stepped: every parameter and
// AdamW state tensor equals the saving job's full tensor (the ep shards put
// together along dimension 0) bit for bit, and every element is written once.
// A mesh whose ep does not divide the checkpoint's experts is an error
// naming the tensor on every rank. An MoE split over ranks is refused by a
// checkpoint without a mesh (which would save one rank's experts as every
// rank's) and by one with a mesh whose "ep" is not the MoE's group.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <mutex>

#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/expert_parallel/moe.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "examples/models/gpt_model.h"
#include "support/engine_worlds.h"
#include "support/rank_errors.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"

namespace cohort::testing::dcp_test::expert_round_trip_test {
namespace {

using namespace cohort::tensor_parallel;

struct Shape {
  int dp = 1, ep = 1, cp = 1;
};

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, const Shape& s) {
  return init_device_mesh(std::move(world), {1, s.dp, s.ep, s.cp, 1},
                          {"pp", "dp", "ep", "cp", "tp"});
}

GPTConfig config(uint64_t seed, int64_t experts = 4) {
  GPTConfig c;
  c.vocab_size = 12;
  c.seq_len = 8;
  c.hidden = 16;
  c.heads = 4;
  c.layers = 2;
  c.experts = experts;
  c.top_k = 2;
  c.seed = seed;
  return c;
}

const auto kAdamW = torch::optim::AdamWOptions(0.01).weight_decay(0.1);

// The test's own knowledge of which tensors the experts split (dim 0).
bool expert_tensor(const std::string& name) {
  for (const char* s : {".moe.w1", ".moe.b1", ".moe.w2", ".moe.b2"}) {
    if (name.find(s) != std::string::npos) return name.find(".step") == std::string::npos;
  }
  return false;
}

// Every checkpoint name -> this rank's tensor (parameter or AdamW state).
Named rank_state(GPTStage& stage, torch::optim::Optimizer& opt) {
  Named out;
  for (const auto& p : stage->named_parameters()) {
    out["model." + p.key()] = p.value().detach().clone();
    auto it = opt.state().find(cohort::optimizer_state_key(p.value()));
    if (it == opt.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out["optim." + p.key() + ".exp_avg"] = s.exp_avg().clone();
    out["optim." + p.key() + ".exp_avg_sq"] = s.exp_avg_sq().clone();
    out["optim." + p.key() + ".step"] = torch::tensor(s.step());
  }
  return out;
}

// Trains two steps at dp x ep and saves into `dir`; returns the full tensors
// (expert shards concatenated over ep), checking the replicas agree.
Named train_and_save(const Shape& shape, const std::string& dir) {
  std::map<std::string, std::map<std::pair<int, int>, torch::Tensor>> shards;  // [ep, dp]
  std::mutex mu;
  run_ranks_shared(shape.dp * shape.ep, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, shape);
    GPTStage stage(mesh, config(7));
    cohort::GradientSynchronizerOptions options;
    options.expert_parameters = stage->expert_parameters();
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight(),
                                      options);
    torch::optim::AdamW opt(stage->parameters(), kAdamW);
    for (int s = 0; s < 2; ++s) {
      auto ids = torch::randint(12, {1, 8}, at::detail::createCPUGenerator(world->rank() + 10 * s));
      opt.zero_grad();
      sync.prepare_forward();
      auto loss = stage->loss(stage(ids), (ids * 5 + 3) % 12);
      sync.after_forward({loss});
      loss.backward();
      sync.finish_backward();
      opt.step();
    }
    dcp::save(dcp::get_state_dict(*stage, opt, {&mesh, gpt_tied_parameters()}), dir, *world);
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [name, t] : rank_state(stage, opt)) {
      shards[name][{mesh.local_rank("ep"), mesh.local_rank("dp")}] = t;
    }
  });
  Named full;
  for (const auto& [name, by_rank] : shards) {
    std::vector<torch::Tensor> parts;
    for (int e = 0; e < shape.ep; ++e) parts.push_back(by_rank.at({e, 0}));
    full[name] = expert_tensor(name) ? torch::cat(parts, 0) : parts[0];
    for (const auto& [at, t] : by_rank) {
      const auto want = expert_tensor(name) ? parts[at.first] : parts[0];
      EXPECT_TRUE(torch::equal(t, want)) << name << " differs between replicas";
    }
  }
  return full;
}

// Loads `dir` at `shape` into another model; every rank's tensors against
// the full ones (its ep slice of an expert tensor).
void load_and_compare(const Shape& shape, const std::string& dir, const Named& expected) {
  std::mutex mu;
  run_ranks_shared(shape.dp * shape.ep * shape.cp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, shape);
    GPTStage stage(mesh, config(99));
    torch::optim::AdamW opt(stage->parameters(), kAdamW);
    auto sd = dcp::get_state_dict(*stage, opt, {&mesh, gpt_tied_parameters()});
    dcp::load(sd, dir, *world);
    dcp::set_state_dict(*stage, opt, sd, {&mesh, gpt_tied_parameters()});
    const auto got = rank_state(stage, opt);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(got.size(), expected.size());
    for (const auto& [name, t] : got) {
      auto it = expected.find(name);
      ASSERT_NE(it, expected.end()) << name;
      auto want = it->second;
      if (expert_tensor(name)) {
        const auto n = want.size(0) / shape.ep;
        want = want.narrow(0, mesh.local_rank("ep") * n, n);
      }
      EXPECT_TRUE(torch::equal(t, want)) << "rank " << mesh.rank() << ": " << name;
    }
  });
}

TEST(ExpertParallelRoundTrip, Dp2Ep2LoadsIntoOneProcessAndCp2) {
  const auto dir = temp_dir("ep_round_trip");
  const auto expected = train_and_save({2, 2, 1}, dir.string());
  // 2 blocks (one dense with 12 tensors, one MoE with 13: two LayerNorms,
  // QKV, projection, router and four expert tensors) + 2 embeddings + 2
  // final LayerNorm = 29 parameters, each with 3 state tensors.
  EXPECT_EQ(expected.size(), 29u * 4);
  const auto meta = dcp::read_metadata(dir.string());
  int64_t bytes = 0, stored = 0;
  for (const auto& [name, t] : expected) bytes += static_cast<int64_t>(t.nbytes());
  bytes += 29 * 6 * static_cast<int64_t>(sizeof(double));  // AdamW's group options
  for (const auto& f : meta.files) stored += f.bytes;
  EXPECT_EQ(stored, bytes) << "every element is written once";
  load_and_compare({1, 1, 1}, dir.string(), expected);
  load_and_compare({1, 1, 2}, dir.string(), expected);
  std::filesystem::remove_all(dir);
}

// Experts split over tp as well (each expert's FFN F / tp per TP rank):
// saved at ep2 x tp2 from the seed's model, loaded in one process into a
// model of other weights, every parameter equals the one-process model of
// the same seed bit for bit (the layouts draw the same model from a seed).
TEST(ExpertParallelRoundTrip, Ep2Tp2ExpertsSplitOverTpLoadIntoOneProcess) {
  const auto dir = temp_dir("ep_tp_round_trip");
  run_ranks_shared(4, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = init_device_mesh(world, {1, 1, 2, 1, 2}, {"pp", "dp", "ep", "cp", "tp"});
    GPTStage stage(mesh, config(7));
    ASSERT_EQ(stage->named_parameters()["block1.moe.w1"].size(1), 2 * 16);  // 4H / tp
    dcp::save(dcp::get_state_dict(*stage, {&mesh, gpt_tied_parameters()}), dir, *world);
  });
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 1, 1});
    GPTStage want(mesh, config(7)), got(mesh, config(99));
    auto sd = dcp::get_state_dict(*got, {&mesh, gpt_tied_parameters()});
    dcp::load(sd, dir.string(), *world);
    dcp::set_state_dict(*got, sd, {&mesh, gpt_tied_parameters()});
    const auto w = want->named_parameters();
    for (const auto& p : got->named_parameters()) {
      EXPECT_TRUE(torch::equal(p.value(), w[p.key()])) << p.key();
    }
  });
  std::filesystem::remove_all(dir);
}

TEST(ExpertParallelRoundTrip, EpThatDoesNotDivideTheExpertsIsAnErrorOnEveryRank) {
  const auto dir = temp_dir("ep_bad");
  // Saved with 2 experts in one process; loaded at ep 4 with 4 experts.
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 1, 1});
    GPTStage stage(mesh, config(7, 2));
    torch::optim::AdamW opt(stage->parameters(), kAdamW);
    dcp::save(dcp::get_state_dict(*stage, opt, {&mesh, gpt_tied_parameters()}), dir, *world);
  });
  auto errors = errors_on_every_rank(4, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 4, 1});
    GPTStage stage(mesh, config(99));
    torch::optim::AdamW opt(stage->parameters(), kAdamW);
    auto sd = dcp::get_state_dict(*stage, opt, {&mesh, gpt_tied_parameters()});
    dcp::load(sd, dir.string(), *world);
  });
  for (const auto& e : errors) {
    EXPECT_NE(e.find("does not divide by the expert-parallel size 4"), std::string::npos) << e;
  }
  std::filesystem::remove_all(dir);
}

// E and F divide by 1, 2 and 3.
expert_parallel::MoEOptions moe_options(uint64_t seed, bool over_tp,
                                        std::shared_ptr<Communicator> group) {
  expert_parallel::MoEOptions o;
  o.hidden = 4;
  o.ffn = 6;
  o.experts = 6;
  o.seed = seed;
  (over_tp ? o.tp_group : o.ep_group) = std::move(group);
  return o;
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

struct SplitCase {
  EngineWorld on;
  bool over_tp;  // each expert's FFN split over the world, else the experts
};

std::vector<SplitCase> split_cases() {
  std::vector<SplitCase> out;
  for (const auto& on : engine_worlds({1, 2, 3})) {
    for (bool over_tp : {false, true}) out.push_back({on, over_tp});
  }
  return out;
}

std::string split_case_text(const SplitCase& c) {
  return c.on.backend + "_world" + std::to_string(c.on.world) + (c.over_tp ? "_tp" : "_ep");
}

std::string split_case_name(const ::testing::TestParamInfo<SplitCase>& info) {
  return split_case_text(info.param);
}

void PrintTo(const SplitCase& c, std::ostream* os) { *os << split_case_text(c); }

ThreadRanksOptions briefly(const EngineWorld& on) {
  auto o = options_for(on);
  o.timeout = std::chrono::seconds(5);
  return o;
}

// Without a mesh every tensor is replicated: written once, loaded by every
// rank. Split experts are refused on every rank; at world 1 (nothing split)
// the round trip restores the saved model. Accepted, how far each rank's
// loaded experts are from what it saved is the figure in the failure.
class SplitExpertsCheckpointedWithoutAMesh : public ::testing::TestWithParam<SplitCase> {};

TEST_P(SplitExpertsCheckpointedWithoutAMesh, AreRefusedOnEveryRank) {
  const auto c = GetParam();
  const auto dir = temp_dir("moe_plain_" + split_case_text(c));
  auto errors = errors_on_every_rank(
      c.on.world,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        expert_parallel::MoE saved(moe_options(7, c.over_tp, world));
        expert_parallel::MoE loaded(moe_options(99, c.over_tp, world));
        torch::optim::AdamW opt(saved->parameters(), kAdamW), other(loaded->parameters(), kAdamW);
        dcp::save(dcp::get_state_dict(saved, opt), dir, *world);
        auto sd = dcp::get_state_dict(loaded, other);
        dcp::load(sd, dir, *world);
        dcp::set_state_dict(loaded, other, sd);
        throw std::runtime_error(
            "accepted; w1 loaded off what this rank saved by " +
            std::to_string((loaded->w1 - saved->w1).abs().max().item<float>()));
      },
      briefly(c.on));
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    if (c.on.world == 1) {
      EXPECT_TRUE(has(e, "accepted; w1 loaded off what this rank saved by 0.000000")) << e;
      continue;
    }
    EXPECT_TRUE(has(e,
                    "dcp::get_state_dict: parameter 'w1' holds only this rank's part of an "
                    "MoE's experts") &&
                has(e, "dcp::StateDictOptions::mesh"))
        << "rank " << r << ": " << e;
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ExpertParallel, SplitExpertsCheckpointedWithoutAMesh,
                         ::testing::ValuesIn(split_cases()), split_case_name);

// A mesh of dp alone with the experts split over the world: the mesh's
// layout would save each rank's [E / ep, ...] experts as a whole tensor,
// written by one dp replica. Refused on every rank; accepted, the shape
// saved is the figure in the failure.
class ExpertsOverAnotherGroupThanTheMeshs : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(ExpertsOverAnotherGroupThanTheMeshs, AreRefusedOnEveryRank) {
  const int n = GetParam().world;
  const auto dir = temp_dir("moe_mesh_" + std::to_string(n));
  auto errors = errors_on_every_rank(
      n,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {1, n, 1}, {"pp", "dp", "tp"});
        expert_parallel::MoE moe(moe_options(7, false, world));
        torch::optim::AdamW opt(moe->parameters(), kAdamW);
        dcp::save(dcp::get_state_dict(*moe, opt, {&mesh, {}}), dir, *world);
        for (const auto& t : dcp::read_metadata(dir.string()).tensors) {
          if (t.fqn == "model.w1")
            throw std::runtime_error("accepted; model.w1 saved as " +
                                     c10::str(c10::IntArrayRef(t.shape)));
        }
        throw std::runtime_error("accepted; no model.w1");
      },
      briefly(GetParam()));
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    if (n == 1) {
      EXPECT_EQ(e, "accepted; model.w1 saved as [6, 6, 4]");
      continue;
    }
    EXPECT_TRUE(has(e,
                    "rank 0: dcp::get_state_dict: the MoE splits its experts over its "
                    "expert-parallel group") &&
                has(e, "has \"ep\" of 1"))
        << "rank " << r << ": " << e;
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ExpertParallel, ExpertsOverAnotherGroupThanTheMeshs,
                         ::testing::ValuesIn(engine_worlds({1, 2, 3})), engine_world_name);

// The experts split over a group of the mesh's "ep" size whose ranks run in
// the other order: each rank's experts are not the ones the mesh places
// there, except on the rank that sits in the middle of both (world 3: rank
// 1). Refused on every rank with an InvalidArgument, the middle rank too,
// which alone saw nothing wrong and went on into save to wait for the
// others; at world 1 the order is the mesh's and the save goes through.
class ExpertsOverTheMeshsEpRanksInAnotherOrder : public ::testing::TestWithParam<EngineWorld> {};

TEST_P(ExpertsOverTheMeshsEpRanksInAnotherOrder, AreRefusedOnEveryRank) {
  const int n = GetParam().world;
  const auto dir = temp_dir("moe_reversed_" + split_case_text({GetParam(), false}));
  auto errors = errors_on_every_rank(
      n,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {1, 1, n, 1}, {"pp", "dp", "ep", "tp"});
        std::vector<int> reversed;
        for (int r = n - 1; r >= 0; --r) reversed.push_back(r);
        expert_parallel::MoE moe(moe_options(7, false, world->new_group(reversed)));
        torch::optim::AdamW opt(moe->parameters(), kAdamW);
        try {
          dcp::save(dcp::get_state_dict(*moe, opt, {&mesh, {}}), dir, *world);
        } catch (const InvalidArgument& e) {
          throw std::runtime_error(std::string("InvalidArgument: ") + e.what());
        }
      },
      briefly(GetParam()));
  for (size_t r = 0; r < errors.size(); ++r) {
    const auto& e = errors[r];
    if (n == 1) {
      EXPECT_EQ(e, kNoError);
      continue;
    }
    // Rank 0 sits at n - 1 of the reversed group, at 0 of the mesh's "ep".
    EXPECT_TRUE(has(e,
                    "InvalidArgument: rank 0: dcp::get_state_dict: the MoE splits its experts "
                    "over its expert-parallel group") &&
                has(e, "(this rank at " + std::to_string(n - 1) + "), but the mesh") &&
                has(e, "has \"ep\" of " + std::to_string(n) + " (this rank at 0)"))
        << "rank " << r << ": " << e;
  }
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ExpertParallel, ExpertsOverTheMeshsEpRanksInAnotherOrder,
                         ::testing::ValuesIn(engine_worlds({1, 2, 3})), engine_world_name);

// The groups are agreed where get_state_dict is called, not again when a
// kept state dict is made anew at save (it is out of date after the
// optimizer's first step): that save issues no more collectives than one
// of a state dict made just before it.
class KeptExpertStateDict : public ::testing::TestWithParam<EngineWorld> {};

uint64_t collectives(const Communicator& comm) {
  uint64_t calls = 0;
  for (const auto& op : comm.stats().ops) calls += op.calls;
  return calls;
}

TEST_P(KeptExpertStateDict, IsMadeAnewAtSaveWithoutAnotherCollective) {
  const int n = GetParam().world;
  const auto dir = temp_dir("moe_kept_" + split_case_text({GetParam(), false}));
  std::mutex mu;
  std::vector<std::pair<uint64_t, uint64_t>> calls;  // stale save, fresh save
  run_ranks_shared(
      n,
      [&](std::shared_ptr<Communicator> world) {
        torch::set_num_threads(1);
        auto mesh = init_device_mesh(world, {1, 1, n, 1}, {"pp", "dp", "ep", "tp"});
        expert_parallel::MoE moe(mesh, moe_options(7, false, nullptr));
        torch::optim::AdamW opt(moe->parameters(), kAdamW);
        auto kept = dcp::get_state_dict(*moe, opt, {&mesh, {}});  // no AdamW state yet
        for (auto& p : moe->parameters()) p.mutable_grad() = torch::ones_like(p);
        opt.step();
        const auto* group = mesh.process_group().get();
        auto count = [&] {
          return collectives(*world) + (group == world.get() ? 0 : collectives(*group));
        };
        const auto before = count();
        dcp::save(kept, dir / "kept", *world);
        const auto stale = count() - before;
        auto fresh_sd = dcp::get_state_dict(*moe, opt, {&mesh, {}});
        const auto made = count();
        dcp::save(fresh_sd, dir / "fresh", *world);
        const auto fresh = count() - made;
        std::lock_guard<std::mutex> lock(mu);
        calls.emplace_back(stale, fresh);
      },
      options_for(GetParam()));
  ASSERT_EQ(calls.size(), static_cast<size_t>(n));
  for (const auto& [stale, fresh] : calls) EXPECT_EQ(stale, fresh);
  // Made anew: the kept state dict's checkpoint holds AdamW's moments.
  int moments = 0;
  for (const auto& t : dcp::read_metadata((dir / "kept").string()).tensors) {
    moments += has(t.fqn, ".exp_avg");
  }
  EXPECT_EQ(moments, 2 * 5);  // router, w1, b1, w2, b2: exp_avg and exp_avg_sq
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(ExpertParallel, KeptExpertStateDict,
                         ::testing::ValuesIn(engine_worlds({1, 3})), engine_world_name);

}  // namespace
}  // namespace cohort::testing::dcp_test::expert_round_trip_test
