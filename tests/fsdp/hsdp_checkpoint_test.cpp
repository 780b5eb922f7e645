// dcp::get_state_dict / set_state_dict on HSDP models: a checkpoint saved
// by HSDP (2 x 2) loads into FSDP at world 3 and into one process, and one
// saved by one process loads into HSDP (2 x 3): the loaded parameters equal
// the saved ones bit for bit, and the next AdamW step (its state and step
// counts loaded) equals the saving job's next step within 1e-6 relative.
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>

#include "cohort/dcp/state_dict/state_dict.h"
#include "cohort/fsdp/fully_shard.h"
#include "cohort/mesh/device_mesh.h"
#include "support/thread_ranks.h"
#include "tests/fsdp/fsdp_test_models.h"

namespace cohort::testing::hsdp_checkpoint_test {
namespace {

using namespace fsdp_test;
namespace fs = std::filesystem;

constexpr int kTrained = 2;  // steps before the save

// A job on `mesh` (none: one process, the plain model); `seed` sets its
// initial values (the loading job's differ from the saving job's).
struct Job {
  Job(const std::optional<DeviceMesh>& mesh, uint64_t seed) : mesh(mesh) {
    auto twin = make_model(nullptr, {});
    init_parameters(*twin, seed);
    if (mesh) {
      sharded = fully_shard(make_model(*mesh, {}), *mesh, {});
      load_from(sharded, *twin);
    } else {
      plain = twin;
    }
    opt = make_optimizer(Opt::AdamW, sharded ? sharded->parameters() : plain->parameters());
  }

  // Step `s` on this rank's slice of the global batch.
  void step(const Batches& b, int s) {
    opt->zero_grad();
    auto x = mesh ? local(b.x[s], *mesh->process_group()) : b.x[s];
    auto y = mesh ? local(b.y[s], *mesh->process_group()) : b.y[s];
    torch::mse_loss(sharded ? sharded->forward(x) : plain->forward(x), y).backward();
    opt->step();
  }

  dcp::StateDict get() {
    return sharded ? dcp::get_state_dict(sharded, *opt) : dcp::get_state_dict(plain, *opt);
  }

  void load(const std::string& dir, Communicator& comm) {
    auto sd = get();
    dcp::load(sd, dir, comm);
    if (sharded) {
      dcp::set_state_dict(sharded, *opt, sd);
    } else {
      dcp::set_state_dict(plain, *opt, sd);
    }
  }

  Named parameters() {
    if (sharded) return sharded->full_state_dict();
    return parameters_of(*plain);
  }

  std::optional<DeviceMesh> mesh;
  FullyShard sharded{nullptr};
  torch::nn::Sequential plain{nullptr};
  std::unique_ptr<torch::optim::Optimizer> opt;
};

// The parameters at the save (or load) and after one more step.
struct Trace {
  Named saved, next;
};

using MakeMesh = std::function<std::optional<DeviceMesh>(std::shared_ptr<Communicator>)>;

// `world` ranks of a job on make_mesh(world): loads `load_dir` (if any),
// trains steps [first, first + steps), saves into `save_dir` (if any), and
// takes step first + steps. Rank `report`'s trace.
Trace run_job(int world, const MakeMesh& make_mesh, const std::string& load_dir, int first,
              int steps, const std::string& save_dir, const Batches& b, int report = 0) {
  Trace out;
  std::mutex mu;
  run_ranks_shared(world, [&](std::shared_ptr<Communicator> comm) {
    torch::set_num_threads(1);
    Job job(make_mesh(comm), load_dir.empty() ? 7 : 99);
    if (!load_dir.empty()) job.load(load_dir, *comm);
    for (int s = first; s < first + steps; ++s) job.step(b, s);
    if (!save_dir.empty()) dcp::save(job.get(), save_dir, *comm);
    auto saved = job.parameters();
    job.step(b, first + steps);
    auto next = job.parameters();
    std::lock_guard<std::mutex> lock(mu);
    if (comm->rank() == report) out = {saved, next};
  });
  return out;
}

std::optional<DeviceMesh> hsdp(std::shared_ptr<Communicator> world, int replicate, int shard) {
  return init_device_mesh(std::move(world), {replicate, shard}, {"replicate", "shard"});
}

std::optional<DeviceMesh> one_process(const std::shared_ptr<Communicator>&) { return {}; }

void expect_equal(const Named& got, const Named& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (const auto& w : want) {
    EXPECT_TRUE(torch::equal(got[w.key()], w.value())) << what << ": " << w.key();
  }
}

fs::path fresh_dir(const std::string& name) {
  auto dir = fs::temp_directory_path() / ("cohort_hsdp_" + name + "_" + std::to_string(getpid()));
  fs::remove_all(dir);
  return dir;
}

TEST(HSDPCheckpoint, SavedByHSDPLoadsIntoFSDPAndOneProcess) {
  const auto b = make_batches(11);
  const auto dir = fresh_dir("from_hsdp").string();
  const auto saved = run_job(
      4, [](auto w) { return hsdp(w, 2, 2); }, "", 0, kTrained, dir, b);
  // Into FSDP at world 3 and into one process: the step after the load is
  // step kTrained of the global batches.
  const std::vector<std::pair<int, MakeMesh>> loaders = {
      {3, [](auto w) { return std::optional<DeviceMesh>(DeviceMesh::from_group(w, "shard")); }},
      {1, one_process}};
  for (const auto& [world, make_mesh] : loaders) {
    const auto loaded = run_job(world, make_mesh, dir, kTrained, 0, "", b);
    const std::string what = "HSDP 2x2 -> world " + std::to_string(world);
    expect_equal(loaded.saved, saved.saved, what + " at the load");
    expect_close(loaded.next, saved.next, 1e-6, what + " next step");
    std::printf("[measured] %s: next step's largest relative error %.3g\n", what.c_str(),
                max_relative_error(loaded.next, saved.next));
  }
  fs::remove_all(dir);
}

TEST(HSDPCheckpoint, SavedByOneProcessLoadsIntoHSDP) {
  const auto b = make_batches(11);
  const auto dir = fresh_dir("into_hsdp").string();
  const auto saved = run_job(1, one_process, "", 0, kTrained, dir, b);
  // Rank 5: of the second replica, which loads what no rank of it saved.
  const auto loaded = run_job(
      6, [](auto w) { return hsdp(w, 2, 3); }, dir, kTrained, 0, "", b, 5);
  expect_equal(loaded.saved, saved.saved, "one process -> HSDP 2x3 at the load");
  expect_close(loaded.next, saved.next, 1e-6, "one process -> HSDP 2x3 next step");
  std::printf("[measured] one process -> HSDP 2x3: next step's largest relative error %.3g\n",
              max_relative_error(loaded.next, saved.next));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace cohort::testing::hsdp_checkpoint_test
