// RngTracker on dp x tp meshes (ranks as threads): its seeds follow the
// documented rule, the replicated stream agrees over each TP group while the
// model-parallel one differs, its state round-trips bitwise, and a restore
// continues only when the whole TP group restores one old group at its own
// TP ranks, every rank of the group reseeding alike otherwise; a generator
// made after a restart (a device's first dropout) starts at the restart, as
// the ones that existed then did, also after a saved state. dropout()
// against the mask drawn by hand, and the Trainer's helpers that find and
// save a model's streams.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cstring>
#include <mutex>

#include "cohort/tensor_parallel/random.h"
#include "support/thread_ranks.h"

namespace cohort::testing::rng_tracker_test {
namespace {

using tensor_parallel::RngTracker;
using tensor_parallel::RngTrackerImpl;

constexpr uint64_t kSeed = 42;
const torch::Device kCpu(torch::kCPU);

struct Shape {
  int dp, tp;
};

std::string shape_name(const ::testing::TestParamInfo<Shape>& info) {
  return "dp" + std::to_string(info.param.dp) + "_tp" + std::to_string(info.param.tp);
}

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, const Shape& s) {
  return init_device_mesh(std::move(world), {s.dp, s.tp}, {"dp", "tp"});
}

torch::Tensor draw(at::Generator gen, int64_t n = 8) { return torch::rand({n}, gen); }
torch::Tensor draw_on(at::Generator gen, const torch::Device& device, int64_t n = 8) {
  return torch::rand({n}, gen, torch::TensorOptions().device(device));
}

// The devices a generator can be made for here: the CPU, and a CUDA device
// where there is one (scripts/gpu-check.sh runs these tests there).
std::vector<torch::Device> devices() {
  std::vector<torch::Device> out{kCpu};
  if (torch::cuda::is_available()) out.emplace_back(torch::kCUDA, 0);
  return out;
}

// Every TP rank's row of `x` ([tp, n]), gathered over the mesh's TP group.
torch::Tensor over_tp(const DeviceMesh& mesh, const torch::Tensor& x) {
  auto all = torch::empty({mesh.size("tp") * x.numel()}, x.options());
  mesh["tp"].process_group()->all_gather_into_tensor(all, x.contiguous()).wait();
  return all.view({mesh.size("tp"), x.numel()});
}

class Tracker : public ::testing::TestWithParam<Shape> {};

TEST_P(Tracker, SeedsFollowTheRule) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker rng(mesh, kSeed);
    const uint64_t g = static_cast<uint64_t>(mesh.local_rank("dp"));
    const uint64_t t = static_cast<uint64_t>(mesh.local_rank("tp"));
    EXPECT_EQ(rng->group(), g);
    EXPECT_EQ(rng->seed("replicated"), kSeed + 1000003 * g);
    EXPECT_EQ(rng->seed("model-parallel"), kSeed + 1000003 * g + 2718 + t);
    // Each generator draws what a fresh CPU generator of its seed draws.
    EXPECT_TRUE(torch::equal(draw(rng->replicated(kCpu)),
                             draw(at::detail::createCPUGenerator(kSeed + 1000003 * g))));
    EXPECT_TRUE(torch::equal(draw(rng->model_parallel(kCpu)),
                             draw(at::detail::createCPUGenerator(kSeed + 1000003 * g + 2718 + t))));
  });
}

TEST_P(Tracker, ReplicatedAgreesOverTpAndModelParallelDiffers) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker rng(mesh, kSeed);
    for (int round = 0; round < 3; ++round) {
      const auto replicated = over_tp(mesh, draw(rng->replicated(kCpu)));
      const auto sharded = over_tp(mesh, draw(rng->model_parallel(kCpu)));
      for (int t = 1; t < mesh.size("tp"); ++t) {
        EXPECT_TRUE(torch::equal(replicated[t], replicated[0])) << "tp rank " << t;
        EXPECT_FALSE(torch::equal(sharded[t], sharded[0])) << "tp rank " << t;
      }
      // Another TP group draws other replicated masks.
      auto other = replicated[0].clone();
      mesh["dp"].process_group()->broadcast(other, {0}).wait();
      EXPECT_EQ(torch::equal(other, replicated[0]), mesh.local_rank("dp") == 0);
    }
  });
}

TEST_P(Tracker, StateRoundTripsBitwise) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker rng(mesh, kSeed);
    draw(rng->replicated(kCpu), 5);
    draw(rng->model_parallel(kCpu), 7);
    const auto saved = rng->state();
    const auto a = draw(rng->replicated(kCpu)), b = draw(rng->model_parallel(kCpu));
    draw(rng->replicated(kCpu), 3);
    rng->set_state(saved);
    EXPECT_TRUE(torch::equal(draw(rng->replicated(kCpu)), a));
    EXPECT_TRUE(torch::equal(draw(rng->model_parallel(kCpu)), b));
  });
}

// A generator made after the state was taken starts over on its restore,
// as one made after it: the state says what every device draws next.
TEST_P(Tracker, AGeneratorMadeSinceTheStateStartsOverOnItsRestore) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker rng(mesh, kSeed);
    const auto saved = rng->state();
    for (const auto& device : devices()) {
      const auto first = draw_on(rng->replicated(device), device);
      draw_on(rng->replicated(device), device);
      rng->set_state(saved);
      EXPECT_TRUE(torch::equal(draw_on(rng->replicated(device), device), first)) << device;
    }
  });
}

// `state` (version 2) as version 1 wrote it: another magic number and no
// current seed after each stream's name.
torch::Tensor as_version_1(const torch::Tensor& state) {
  const auto* in = state.data_ptr<uint8_t>();
  size_t at = 0;
  std::vector<uint8_t> out;
  auto copy = [&](size_t n) {
    out.insert(out.end(), in + at, in + at + n);
    at += n;
  };
  auto u64 = [&] {
    uint64_t v = 0;
    std::memcpy(&v, in + at, sizeof v);
    return v;
  };
  // A length, then that many bytes.
  auto bytes = [&] { copy(8 + u64()); };
  const uint64_t magic_v1 = 0x31676e7274726f63ULL;  // "cortrng1"
  out.insert(out.end(), reinterpret_cast<const uint8_t*>(&magic_v1),
             reinterpret_cast<const uint8_t*>(&magic_v1) + 8);
  at = 8;
  copy(24);  // tp rank, tp size, group
  const auto streams = u64();
  copy(8);
  for (uint64_t i = 0; i < streams; ++i) {
    bytes();  // the name
    at += 8;  // the current seed, which version 1 lacks
    const auto devices = u64();
    copy(8);
    for (uint64_t d = 0; d < devices; ++d) {
      bytes();  // the device
      bytes();  // its generator's state
    }
  }
  EXPECT_EQ(at, static_cast<size_t>(state.numel()));
  return torch::from_blob(out.data(), {static_cast<int64_t>(out.size())}, torch::kUInt8).clone();
}

// A state written before the streams' current seeds were saved (a
// checkpoint of an earlier build) still continues its generators.
TEST_P(Tracker, AVersion1StateContinues) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker rng(mesh, kSeed), resumed(mesh, kSeed);
    draw(rng->replicated(kCpu), 5);
    draw(rng->model_parallel(kCpu), 7);
    resumed->set_state(as_version_1(rng->state()));
    EXPECT_TRUE(torch::equal(draw(resumed->replicated(kCpu)), draw(rng->replicated(kCpu))));
    EXPECT_TRUE(torch::equal(draw(resumed->model_parallel(kCpu)), draw(rng->model_parallel(kCpu))));
  });
}

// What one TP group restores: each rank its own state, one rank none, or
// (dp 2) one rank the other group's state at its TP rank.
enum class Restore { Own, OneRankWithout, OneRankFromAnotherGroup };

// Per rank: the draws after restore_rng_state, and the draws a tracker
// continuing its saved state makes.
void check_restore(const Shape& shape, Restore how) {
  run_ranks_shared(shape.dp * shape.tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, shape);
    RngTracker rng(mesh, kSeed);
    draw(rng->replicated(kCpu), 3);
    draw(rng->model_parallel(kCpu), 4);
    auto state = rng->state();
    const auto continued = draw(rng->replicated(kCpu));
    const bool last_tp = mesh.local_rank("tp") == mesh.size("tp") - 1;
    if (how == Restore::OneRankWithout && last_tp) state = torch::Tensor();
    if (how == Restore::OneRankFromAnotherGroup) {
      // dp group 0's states go to dp group 1 and back, for every TP rank
      // but the last, which keeps its own.
      auto other = state.clone();
      auto dp = mesh["dp"].process_group();
      std::vector<torch::Tensor> out{torch::empty_like(other), torch::empty_like(other)};
      dp->all_gather(out, other).wait();
      if (!last_tp) state = out[1 - mesh.local_rank("dp")];
    }
    rng->restore_rng_state(state, /*step=*/5);
    const auto got = draw(rng->replicated(kCpu));
    const auto sharded = draw(rng->model_parallel(kCpu));
    // The TP group's replicated streams agree whatever it restored.
    const auto all = over_tp(mesh, got);
    for (int t = 1; t < mesh.size("tp"); ++t) EXPECT_TRUE(torch::equal(all[t], all[0]));
    // The last TP rank keeps its own state when it takes another group's.
    const bool continues =
        how == Restore::Own || (how == Restore::OneRankFromAnotherGroup && shape.tp == 1);
    EXPECT_EQ(torch::equal(got, continued), continues) << "tp rank " << mesh.local_rank("tp");
    if (continues) return;
    // Reseeded: what a fresh tracker reseeded at the same step draws.
    RngTracker fresh(mesh, kSeed);
    fresh->reseed(5);
    EXPECT_TRUE(torch::equal(got, draw(fresh->replicated(kCpu))));
    EXPECT_TRUE(torch::equal(sharded, draw(fresh->model_parallel(kCpu))));
  });
}

// Restarted at another layout (restore_rng_state without a state), a
// tracker that had made no generator yet makes them at the restart, as one
// that held them then: not at the stream's original seed, whose masks the
// job before the restart drew.
TEST_P(Tracker, AGeneratorMadeAfterARestartStartsAtTheRestart) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker held(mesh, kSeed), made_later(mesh, kSeed);
    for (const auto& device : devices()) held->generators(device);
    held->restore_rng_state(torch::Tensor(), /*step=*/5);
    made_later->restore_rng_state(torch::Tensor(), /*step=*/5);
    for (const auto& device : devices()) {
      for (const auto& name : held->names()) {
        SCOPED_TRACE(name + " on " + device.str());
        auto made = made_later->generator(name, device);
        const auto expected = held->generator(name, device);
        EXPECT_NE(expected.current_seed(), held->seed(name));  // restarted
        EXPECT_EQ(made.current_seed(), expected.current_seed());
        EXPECT_TRUE(torch::equal(draw_on(made, device), draw_on(expected, device)));
      }
      // Still alike over the TP group where the stream is replicated.
      const auto replicated = over_tp(mesh, draw_on(made_later->replicated(device), device).cpu());
      for (int t = 1; t < mesh.size("tp"); ++t) {
        EXPECT_TRUE(torch::equal(replicated[t], replicated[0])) << "tp rank " << t;
      }
    }
  });
}

// The restart's seed is part of the state: a tracker resumed at the same
// layout from the state of a restarted one that had made no generator yet
// makes them at that restart too.
TEST_P(Tracker, TheRestartSurvivesTheState) {
  run_ranks_shared(GetParam().dp * GetParam().tp, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, GetParam());
    RngTracker restarted(mesh, kSeed), resumed(mesh, kSeed), held(mesh, kSeed);
    for (const auto& device : devices()) held->generators(device);
    held->restore_rng_state(torch::Tensor(), /*step=*/5);
    restarted->restore_rng_state(torch::Tensor(), /*step=*/5);
    resumed->set_state(restarted->state());
    for (const auto& device : devices()) {
      for (const auto& name : held->names()) {
        SCOPED_TRACE(name + " on " + device.str());
        auto made = resumed->generator(name, device);
        EXPECT_NE(made.current_seed(), resumed->seed(name));
        EXPECT_EQ(made.current_seed(), held->generator(name, device).current_seed());
      }
    }
  });
}

TEST_P(Tracker, RestoreOfItsOwnStatesContinues) { check_restore(GetParam(), Restore::Own); }

TEST_P(Tracker, RestoreWithoutOneRanksStateReseedsTheGroupAlike) {
  check_restore(GetParam(), Restore::OneRankWithout);
}

INSTANTIATE_TEST_SUITE_P(Meshes, Tracker,
                         ::testing::Values(Shape{1, 1}, Shape{1, 2}, Shape{1, 3}, Shape{2, 2},
                                           Shape{2, 3}),
                         shape_name);

// Two TP groups at least: their ranks but the last swap states.
TEST(TrackerRestore, MixedGroupsReseedTheGroupAlike) {
  for (const Shape shape : {Shape{2, 1}, Shape{2, 2}, Shape{2, 3}}) {
    SCOPED_TRACE("dp" + std::to_string(shape.dp) + " tp" + std::to_string(shape.tp));
    check_restore(shape, Restore::OneRankFromAnotherGroup);
  }
}

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

template <typename Fn>
std::string error_of(Fn fn) {
  try {
    fn();
  } catch (const InvalidArgument& e) {
    return e.what();
  }
  return "no error";
}

TEST(TrackerErrors, BadStatesNamesAndSeedsAreRefused) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {2}, {"tp"});
    RngTracker rng(mesh, kSeed);
    // Another TP rank's state, with nothing changed.
    std::vector<torch::Tensor> states{torch::empty_like(rng->state()),
                                      torch::empty_like(rng->state())};
    world->all_gather(states, rng->state()).wait();
    const int other = 1 - world->rank();
    const auto before = rng->state();
    EXPECT_TRUE(has(error_of([&] { rng->set_state(states[other]); }),
                    "the state is tp rank " + std::to_string(other) + " of 2's"));
    EXPECT_TRUE(torch::equal(rng->state(), before));
    EXPECT_TRUE(has(error_of([&] { rng->set_state(before.narrow(0, 0, 40)); }), "ends early"));
    EXPECT_TRUE(has(error_of([&] { rng->set_state(torch::zeros({64}, torch::kUInt8)); }),
                    "not an RngTracker's state"));
    EXPECT_TRUE(has(error_of([&] { rng->add("replicated", 1); }), "stream 'replicated' exists"));
    EXPECT_TRUE(has(error_of([&] { rng->add("mine", kSeed); }), "is stream 'replicated''s"));
    EXPECT_TRUE(has(error_of([&] { rng->generator("nope", kCpu); }),
                    "no stream 'nope' (it has model-parallel, replicated)"));
    EXPECT_TRUE(has(error_of([&] { rng->generator("replicated", torch::Device("cuda")); }),
                    "device cuda has no index"));
    // A stream of one's own joins the state.
    rng->add("mine", 7);
    EXPECT_EQ(rng->names(), (std::vector<std::string>{"mine", "model-parallel", "replicated"}));
    EXPECT_TRUE(has(error_of([&] { rng->set_state(before); }),
                    "the state has the streams 'model-parallel' 'replicated', this tracker "
                    "'mine' 'model-parallel' 'replicated'"));
  });
}

TEST(TrackerDropout, DrawsTheDocumentedMask) {
  const double p = 0.3;
  // Non-contiguous input: the mask is still drawn in row-major order.
  const auto x = torch::randn({4, 3, 5}, at::detail::createCPUGenerator(1)).permute({1, 0, 2});
  auto xg = x.clone().requires_grad_();
  const auto y = tensor_parallel::dropout(xg, p, true, at::detail::createCPUGenerator(9));
  const auto keep = torch::empty({3, 4, 5}).bernoulli_(1 - p, at::detail::createCPUGenerator(9));
  EXPECT_TRUE(torch::equal(y, x * (keep / (1 - p))));
  const auto zeros = keep.eq(0).sum().item<int64_t>();
  EXPECT_GT(zeros, 0);
  EXPECT_LT(zeros, keep.numel());
  y.sum().backward();
  EXPECT_TRUE(torch::equal(xg.grad(), keep / (1 - p)));
  // Not training, or p 0: the input itself; p 1: zeros.
  auto gen = at::detail::createCPUGenerator(9);
  EXPECT_TRUE(tensor_parallel::dropout(x, p, false, gen).is_same(x));
  EXPECT_TRUE(tensor_parallel::dropout(x, 0, true, gen).is_same(x));
  EXPECT_TRUE(torch::equal(tensor_parallel::dropout(x, 1, true, gen), torch::zeros_like(x)));
  EXPECT_TRUE(has(error_of([&] { tensor_parallel::dropout(x, 1.5, true, gen); }),
                  "p 1.5 is not in [0, 1]"));
  EXPECT_TRUE(has(error_of([&] { tensor_parallel::dropout(x, p, true, at::Generator()); }),
                  "no generator"));
}

// What the Trainer does with a model's streams: finds each tracker once,
// saves them in one tensor whose zero padding (to another rank's length)
// is ignored, and gives each its part back; another number of trackers
// restarts them all.
TEST(TrackerInAModel, TheTrainersHelpersFindSaveAndRestoreIt) {
  run_ranks_shared(2, [&](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {2}, {"tp"});
    auto model = std::make_shared<torch::nn::Module>();
    auto a = model->register_module("a", RngTracker(mesh, 1));
    auto inner = model->register_module("inner", std::make_shared<torch::nn::Module>());
    inner->register_module("a_again", a);
    auto b = inner->register_module("b", RngTracker(mesh, 2));
    const auto streams = rng_streams_of(*model);
    ASSERT_EQ(streams.size(), 2u);
    EXPECT_EQ(streams[0], a.get());
    EXPECT_EQ(streams[1], b.get());
    draw(a->replicated(kCpu));
    auto saved = rng_streams_state(streams);
    saved = torch::cat({saved, torch::zeros({17}, torch::kUInt8)});
    const auto next_a = draw(a->replicated(kCpu)), next_b = draw(b->model_parallel(kCpu));
    restore_rng_streams(streams, saved, 3);
    EXPECT_TRUE(torch::equal(draw(a->replicated(kCpu)), next_a));
    EXPECT_TRUE(torch::equal(draw(b->model_parallel(kCpu)), next_b));
    // The state of a model with one tracker: both restart from step 3.
    restore_rng_streams(streams, rng_streams_state({a.get()}), 3);
    RngTracker fresh(mesh, 1);
    fresh->reseed(3);
    EXPECT_TRUE(torch::equal(draw(a->replicated(kCpu)), draw(fresh->replicated(kCpu))));
    EXPECT_TRUE(rng_streams_state({}).numel() == 0);
  });
}

}  // namespace
}  // namespace cohort::testing::rng_tracker_test
