// Tensor-parallel and pipeline checkpoints move between meshes exactly, through
// dcp::get_state_dict / load / set_state_dict into optimizers that have not
// stepped (the saved rate restored too): the
// GPT trained three AdamW steps at tp2 x pp2 x dp2 is saved, then loaded at
// tp1 x pp4 x dp2, tp2 x pp1 x dp1 and tp1 x pp1 x dp1 (one process, whole
// tensors), and every parameter and optimizer state tensor (each shard
// against the matching slice of the full tensor the saving job held) equals
// it bit for bit. A mesh whose tp does not divide a checkpointed dimension
// is an error naming the tensor on every rank, with nothing loaded.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/adamw.h>

#include <mutex>

#include "ckpt_files.h"
#include "cohort/dcp/checkpoint_file.h"
#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/dcp/torch_file.h"
#include "cohort/dcp/weights_file.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/schedule.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/thread_ranks.h"
#include "tests/dcp/dcp_test_support.h"
#include "tests/dcp/python_peer.h"

namespace cohort::testing::dcp_test::tp_round_trip_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int64_t kBatch = 4;

// A (dp, pp, tp) layout: the mesh (pp, dp, tp), TP fastest.
struct Shape {
  int dp = 1, pp = 1, tp = 1;
  std::string to_string() const {
    return "dp" + std::to_string(dp) + "_pp" + std::to_string(pp) + "_tp" + std::to_string(tp);
  }
};

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, const Shape& s) {
  return init_device_mesh(std::move(world), {s.pp, s.dp, s.tp}, {"pp", "dp", "tp"});
}

GPTConfig config(uint64_t seed, int64_t vocab = 12) {
  GPTConfig c;
  c.vocab_size = vocab;
  c.seq_len = 6;
  c.hidden = 24;
  c.heads = 6;
  c.layers = 4;
  c.seed = seed;
  return c;
}

// The dimension the tensor-parallel layers split, by the GPT's names (the
// test's own knowledge, independent of the adapter); -1: whole.
int64_t split_dim(const std::string& name) {
  for (const char* s : {"qkv.weight", "qkv.bias", "fc1.weight", "fc1.bias", "embeddings.weight"}) {
    if (name.find(s) != std::string::npos) return 0;
  }
  for (const char* s : {"proj.weight", "fc2.weight"}) {
    if (name.find(s) != std::string::npos) return 1;
  }
  return -1;
}

std::string checkpoint_name(const std::string& param) {
  const auto tied = gpt_tied_parameters();
  auto it = tied.find(param);
  return it == tied.end() ? param : it->second;
}

// Every checkpoint name -> this rank's tensor (parameter or optimizer state).
Named rank_state(GPTStage& stage, torch::optim::Optimizer& opt) {
  Named out;
  for (const auto& p : stage->named_parameters()) {
    const auto name = checkpoint_name(p.key());
    out["model." + name] = p.value().detach().clone();
    auto it = opt.state().find(cohort::optimizer_state_key(p.value()));
    if (it == opt.state().end()) continue;
    auto& s = static_cast<torch::optim::AdamWParamState&>(*it->second);
    out["optim." + name + ".exp_avg"] = s.exp_avg().clone();
    out["optim." + name + ".exp_avg_sq"] = s.exp_avg_sq().clone();
    out["optim." + name + ".step"] = torch::tensor(s.step());
  }
  return out;
}

// The part of `full` that TP rank `r` of `tp` holds.
torch::Tensor slice_of(const torch::Tensor& full, const std::string& name, int tp, int r) {
  const auto d = split_dim(name);
  if (d < 0 || tp == 1 || full.dim() == 0) return full;
  const auto n = full.size(d) / tp;
  return full.narrow(d, r * n, n);
}

void train_step(DeviceMesh& mesh, GPTStage& stage, pipeline::PipelineRuntime* rt,
                cohort::GradientSynchronizer& sync, torch::optim::Optimizer& opt, int s) {
  const auto& c = stage->config();
  auto ids =
      torch::randint(c.vocab_size, {kBatch, c.seq_len}, at::detail::createCPUGenerator(100 + s));
  auto targets = (ids * 5 + 3) % c.vocab_size;
  const auto rows = kBatch / mesh.size("dp");
  ids = ids.narrow(0, mesh.local_rank("dp") * rows, rows);
  targets = targets.narrow(0, mesh.local_rank("dp") * rows, rows);
  opt.zero_grad();
  if (rt) {
    rt->step({ids}, {targets});
    sync.synchronize();
  } else {
    sync.prepare_forward();
    auto loss = stage->loss(stage(ids), targets);
    sync.after_forward({loss});
    loss.backward();
    sync.finish_backward();
  }
  opt.step();
}

// One rank's GPT stage at `shape`, its AdamW (kAdamW) and what steps it.
struct GptJob {
  GptJob(std::shared_ptr<Communicator> world, const Shape& shape, const GPTConfig& c)
      : mesh(mesh_of(std::move(world), shape)),
        stage(mesh, c),
        sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
             stage->shared_embedding_weight()),
        opt(stage->parameters(), kAdamW) {
    if (shape.pp > 1)
      rt = std::make_unique<pipeline::PipelineRuntime>(
          mesh["pp"], std::vector<pipeline::PipelineStage>{gpt_pipeline_stage(mesh, stage)},
          pipeline::make_schedule("1f1b", shape.pp, 1, 2), gpt_pipeline_loss(stage));
  }
  void step(int s) { train_step(mesh, stage, rt.get(), sync, opt, s); }
  dcp::StateDictOptions options() const { return {&mesh, gpt_tied_parameters()}; }

  DeviceMesh mesh;
  GPTStage stage;
  cohort::GradientSynchronizer sync;
  torch::optim::AdamW opt;
  std::unique_ptr<pipeline::PipelineRuntime> rt;
};

// What a schedule would have changed by the checkpoint.
constexpr double kSavedLr = 0.004;

// Trains `steps` steps at `shape`, sets the rate to kSavedLr and saves into
// `dir`; returns the full tensors the job held, assembled from the TP
// shards of DP replica 0.
Named train_and_save(const Shape& shape, int steps, const std::string& dir, const GPTConfig& c) {
  std::map<std::string, std::vector<torch::Tensor>> shards;
  std::mutex mu;
  run_ranks_shared(shape.dp * shape.pp * shape.tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    GptJob job(world, shape, c);
    auto& mesh = job.mesh;
    auto& stage = job.stage;
    auto& opt = job.opt;
    for (int s = 0; s < steps; ++s) job.step(s);
    for (auto& g : opt.param_groups()) g.options().set_lr(kSavedLr);
    dcp::save(dcp::get_state_dict(*stage, opt, job.options()), dir, *world);
    std::lock_guard<std::mutex> lock(mu);
    for (auto& [name, t] : rank_state(stage, opt)) {
      auto& v = shards[name];
      v.resize(shape.tp * shape.dp * 2);  // [copy][dp][tp]
      const bool copy = stage->named_parameters().find("output_embeddings.weight") &&
                        name.find("word_embeddings") != std::string::npos;
      v[(copy ? shape.dp * shape.tp : 0) + mesh.local_rank("dp") * shape.tp +
        mesh.local_rank("tp")] = t;
    }
  });
  Named full;
  for (const auto& [name, v] : shards) {
    const auto d = split_dim(name);
    std::vector<torch::Tensor> parts(v.begin(), v.begin() + shape.tp);
    full[name] = d >= 0 && parts[0].dim() > 0 ? torch::cat(parts, d) : parts[0];
    // Replicas (DP, TP for whole tensors, the tied copy) hold the same values:
    // a checkpoint that writes them once loses nothing.
    for (size_t k = 0; k < v.size(); ++k) {
      if (!v[k].defined()) continue;
      const int tp_rank = static_cast<int>(k) % shape.tp;
      EXPECT_TRUE(torch::equal(v[k], slice_of(full[name], name, shape.tp, tp_rank))) << name;
    }
  }
  return full;
}

struct Load {
  Shape shape;
};

class TensorParallelRoundTrip : public ::testing::TestWithParam<Load> {};

TEST_P(TensorParallelRoundTrip, LoadsExactlyIntoAnotherMesh) {
  const auto to = GetParam().shape;
  const auto dir = temp_dir("tp_" + to.to_string());
  const auto expected = train_and_save({2, 2, 2}, 3, dir.string(), config(7));
  // 4 blocks x 12 tensors + 2 embeddings + 2 final LayerNorm, each with 3
  // state tensors; the tied copy saved once.
  ASSERT_EQ(expected.size(), 52u * 4);
  const auto meta = dcp::read_metadata(dir.string());
  int64_t bytes = 0, stored = 0;
  for (const auto& [name, t] : expected) bytes += static_cast<int64_t>(t.nbytes());
  // And each parameter's group options (AdamW: lr, two betas, eps, weight
  // decay, amsgrad), 0-d float64, once per parameter.
  bytes += 52 * 6 * static_cast<int64_t>(sizeof(double));
  for (const auto& f : meta.files) stored += f.bytes;
  EXPECT_EQ(stored, bytes) << "every element is written once";
  // The checkpoint holds the full tensors (read without the adapter).
  for (const auto& [name, t] : expected) {
    EXPECT_TRUE(torch::equal(dcp::read_tensor(dir.string(), meta, name), t)) << name;
  }

  std::mutex mu;
  int compared = 0;
  run_ranks_shared(to.dp * to.pp * to.tp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, to);
    GPTStage stage(mesh, config(99));  // other weights, no optimizer state
    torch::optim::AdamW opt(stage->parameters(), kAdamW);
    auto sd = dcp::get_state_dict(*stage, opt, {&mesh, gpt_tied_parameters()});
    dcp::load(sd, dir.string(), *world, &meta);
    dcp::set_state_dict(*stage, opt, sd, {&mesh, gpt_tied_parameters()});
    const auto got = rank_state(stage, opt);
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(opt.param_groups()[0].options().get_lr(), kSavedLr);
    EXPECT_EQ(got.size(), stage->parameters().size() * 4);
    for (const auto& [name, t] : got) {
      auto it = expected.find(name);
      ASSERT_NE(it, expected.end()) << name;
      EXPECT_TRUE(torch::equal(t, slice_of(it->second, name, to.tp, mesh.local_rank("tp"))))
          << "rank " << mesh.rank() << ": " << name;
      ++compared;
    }
  });
  EXPECT_GE(compared, static_cast<int>(expected.size()));
  std::filesystem::remove_all(dir);
}

// get_state_dict -> save -> a fresh stage and optimizer -> get_state_dict
// -> load -> set_state_dict at the same mesh (tp 3, pp 3, one process):
// every tensor and the rate equal the saving job's bit for bit, and so
// does the next step's.
class TensorParallelContinues : public ::testing::TestWithParam<Load> {};

TEST_P(TensorParallelContinues, NextStepEqualsTheSavingJobs) {
  const auto shape = GetParam().shape;
  const auto dir = temp_dir("tp_continue_" + shape.to_string());
  auto c = config(7);
  c.layers = 3;  // divides by pp 3
  std::map<int, Named> saved, continued;
  std::mutex mu;
  const int world = shape.dp * shape.pp * shape.tp;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    GptJob job(comm, shape, c);
    for (int s = 0; s < 2; ++s) job.step(s);
    for (auto& g : job.opt.param_groups()) g.options().set_lr(kSavedLr);
    dcp::save(dcp::get_state_dict(*job.stage, job.opt, job.options()), dir.string(), *comm);
    auto at_save = rank_state(job.stage, job.opt);
    job.step(2);
    std::lock_guard<std::mutex> lock(mu);
    saved[comm->rank()] = std::move(at_save);
    continued[comm->rank()] = rank_state(job.stage, job.opt);
  });
  c.seed = 99;  // other weights, no optimizer state
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    GptJob job(comm, shape, c);
    auto sd = dcp::get_state_dict(*job.stage, job.opt, job.options());
    dcp::load(sd, dir.string(), *comm);
    dcp::set_state_dict(*job.stage, job.opt, sd, job.options());
    const auto loaded = rank_state(job.stage, job.opt);
    const double lr = job.opt.param_groups()[0].options().get_lr();
    job.step(2);
    const auto where = "rank " + std::to_string(comm->rank());
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(lr, kSavedLr) << where;
    expect_equal(loaded, saved.at(comm->rank()), where + ", loaded");
    expect_equal(rank_state(job.stage, job.opt), continued.at(comm->rank()), where + ", next");
  });
  std::filesystem::remove_all(dir);
}

// A state dict made before the first step (AdamW makes its state then),
// kept and saved after two: a fresh stage and optimizer load every
// parameter's state and step equal to the saving job's bit for bit, at tp 3
// and in one process.
class TensorParallelKept : public ::testing::TestWithParam<Load> {};

TEST_P(TensorParallelKept, AStateDictMadeBeforeTheFirstStepSavesTheState) {
  const auto shape = GetParam().shape;
  const auto dir = temp_dir("tp_kept_" + shape.to_string());
  auto c = config(7);
  std::map<int, Named> saved;
  std::mutex mu;
  const int world = shape.dp * shape.pp * shape.tp;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    GptJob job(comm, shape, c);
    auto sd = dcp::get_state_dict(*job.stage, job.opt, job.options());
    for (int s = 0; s < 2; ++s) job.step(s);
    dcp::save(sd, dir.string(), *comm);
    std::lock_guard<std::mutex> lock(mu);
    saved[comm->rank()] = rank_state(job.stage, job.opt);
  });
  c.seed = 99;  // other weights, no optimizer state
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    GptJob job(comm, shape, c);
    auto sd = dcp::get_state_dict(*job.stage, job.opt, job.options());
    dcp::load(sd, dir.string(), *comm);
    const auto loaded = rank_state(job.stage, job.opt);
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(loaded, saved.at(comm->rank()), "rank " + std::to_string(comm->rank()));
  });
  std::filesystem::remove_all(dir);
}

INSTANTIATE_TEST_SUITE_P(Meshes, TensorParallelKept,
                         ::testing::Values(Load{{1, 1, 3}}, Load{{1, 1, 1}}), [](const auto& info) {
                           return "tp" + std::to_string(info.param.shape.tp);
                         });

INSTANTIATE_TEST_SUITE_P(Meshes, TensorParallelContinues,
                         ::testing::Values(Load{{1, 1, 3}}, Load{{1, 3, 1}}, Load{{1, 1, 1}}),
                         [](const auto& info) {
                           const auto& s = info.param.shape;
                           return "tp" + std::to_string(s.tp) + "_pp" + std::to_string(s.pp);
                         });

INSTANTIATE_TEST_SUITE_P(Meshes, TensorParallelRoundTrip,
                         ::testing::Values(Load{{2, 4, 1}}, Load{{1, 1, 2}}, Load{{1, 1, 1}}),
                         [](const auto& info) {
                           const auto& s = info.param.shape;
                           return "tp" + std::to_string(s.tp) + "_pp" + std::to_string(s.pp) +
                                  "_dp" + std::to_string(s.dp);
                         });

// A vocabulary of 14 saved at tp 2 cannot be split over tp 3 (whose model
// pads it to 15): every rank throws naming the tensor; nothing changes.
TEST(TensorParallelBadInput, TpThatDoesNotDivideIsAnErrorOnEveryRank) {
  const auto dir = temp_dir("tp_divide");
  train_and_save({1, 1, 2}, 1, dir.string(), config(7, 14));
  const auto meta = dcp::read_metadata(dir.string());
  std::mutex mu;
  int errors = 0;
  run_ranks_shared(3, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, {1, 1, 3});
    GPTStage stage(mesh, config(99, 15));
    torch::optim::AdamW opt(stage->parameters(), kAdamW);
    const auto before = rank_state(stage, opt);
    try {
      auto sd = dcp::get_state_dict(*stage, opt, {&mesh, gpt_tied_parameters()});
      dcp::load(sd, dir.string(), *world, &meta);
      ADD_FAILURE() << "rank " << mesh.rank() << " loaded";
    } catch (const CheckpointError& e) {
      const std::string what = e.what();
      std::lock_guard<std::mutex> lock(mu);
      EXPECT_NE(what.find("model.word_embeddings.weight"), std::string::npos) << what;
      EXPECT_NE(what.find("does not divide by the tensor-parallel size 3"), std::string::npos)
          << what;
      ++errors;
    }
    std::lock_guard<std::mutex> lock(mu);
    expect_equal(rank_state(stage, opt), before, "rank " + std::to_string(mesh.rank()));
  });
  EXPECT_EQ(errors, 3);
  std::filesystem::remove_all(dir);
}

// cohort-ckpt export of a pp 2 x tp 2 checkpoint (one training step) is the
// one-process model's state dict (the checkpoint loaded at tp1 x pp1 x dp1)
// to the bit, as sharded safetensors and as a torch.save dict, read by
// cohort and by Python (torch.load; safetensors where installed); import
// turns the file back into a checkpoint; and load_weights initializes a
// pp 2 x tp 2 model from the safetensors, each rank reading its stage's
// slices.
TEST(TensorParallelExport, Pp2Tp2ExportIsTheOneProcessModel) {
  const auto dir = temp_dir("tp_export");
  const auto ckpt = (dir / "ckpt").string();
  const auto expected = train_and_save({1, 2, 2}, 1, ckpt, config(7));
  const auto meta = dcp::read_metadata(ckpt);
  dcp::NamedTensors one;
  run_ranks_shared(1, [&](std::shared_ptr<Communicator> world) {
    auto mesh = mesh_of(world, {1, 1, 1});
    GPTStage stage(mesh, config(99));
    const dcp::StateDictOptions o{&mesh, gpt_tied_parameters()};
    auto sd = dcp::get_state_dict(*stage, o);
    dcp::load(sd, ckpt, *world, &meta);
    dcp::set_state_dict(*stage, sd, o);
    for (const auto& p : stage->named_parameters()) one.insert(p.key(), p.value().detach().clone());
    for (const auto& b : stage->named_buffers()) one.insert(b.key(), b.value().clone());
  });
  const auto st = (dir / "model.safetensors").string();
  const auto files = cohort_ckpt::export_checkpoint(ckpt, st, {"safetensors", "model.", 40000});
  EXPECT_GT(files.size(), 2u);  // shards and the index
  const auto pt = (dir / "model.pt").string();
  cohort_ckpt::export_checkpoint(ckpt, pt, {"torch"});
  expect_same(dcp::load_safetensors(files.back()), one);
  expect_same(dcp::load_torch(pt), one);
  // Python reads them: torch.load, and safetensors where it is installed.
  run_peer({"torch-read", pt, (dir / "py_pt").string()});
  expect_read_by_python(dir / "py_pt", one);
  if (auto reason = python_lacks_safetensors()) {
    std::printf("safetensors part skipped: %s\n", reason->c_str());
  } else {
    const auto whole = (dir / "whole.safetensors").string();
    cohort_ckpt::export_checkpoint(ckpt, whole);
    run_peer({"st-read", whole, (dir / "py_st").string()});
    expect_read_by_python(dir / "py_st", one);
  }

  // And back: cohort-ckpt import writes the file as a checkpoint.
  const auto imported = (dir / "imported").string();
  EXPECT_EQ(cohort_ckpt::import_weights(files.back(), imported), static_cast<int>(one.size()));
  const auto back = dcp::read_metadata(imported);
  for (const auto& item : one) {
    EXPECT_TRUE(torch::equal(dcp::read_tensor(imported, back, "model." + item.key()), item.value()))
        << item.key();
  }

  std::mutex mu;
  run_ranks_shared(4, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, {1, 2, 2});
    GPTStage stage(mesh, config(99));
    auto sd = dcp::get_state_dict(*stage, {&mesh, gpt_tied_parameters()});  // all it holds
    dcp::LoadWeightsOptions options;
    options.allow_unexpected = true;  // the other stage's tensors
    options.comm = world.get();
    dcp::load_weights(sd, files.back(), options);
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& p : stage->named_parameters()) {
      const auto name = "model." + checkpoint_name(p.key());
      EXPECT_TRUE(
          torch::equal(p.value(), slice_of(expected.at(name), name, 2, mesh.local_rank("tp"))))
          << "rank " << mesh.rank() << ": " << name;
    }
  });
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace cohort::testing::dcp_test::tp_round_trip_test
