// Run: cohortrun -n 4 -- build/examples/fsdp/fsdp_train --mode fsdp
//      cohortrun -n 4 -- build/examples/fsdp/fsdp_train --mode fsdp --replicate 2   # HSDP
//
// A stack of `--layers` Linear(width, width) + tanh blocks trained through
// cohort::Trainer with AdamW, fully sharded (--mode fsdp: each block a
// fully_shard unit, TrainerWiring::fsdp) or replicated (--mode ddp). With
// --replicate R, FSDP is hybrid (HSDP): the mesh is R replicas x N/R shards,
// each block sharded within a replica's group and its gradient shards
// averaged across the replicas. Each rank prints the bytes of parameters,
// gradients and AdamW state it holds after the last step, and its peak
// resident memory. With --checkpoint-dir the Trainer saves a distributed
// checkpoint at the end, which resumes in any mode at any world size.
//
// Beyond DDP: under one per-rank memory limit of 2400 MiB (ulimit -v,
// inherited by every rank), the default model (40 blocks of 2048: 640 MiB of
// fp32 weights, so 2561 MiB of weights + gradients + AdamW state per rank
// under DDP, more than the limit on their own; 640 MiB at world 4 under FSDP)
// trains at world 4 under FSDP, and DDP stops with an out-of-memory error
// (exit status 1, reported by cohortrun); see docs/usage.md, "Fully sharded
// data parallelism", for the command.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <fstream>
#include <memory>
#include <new>
#include <optional>
#include <string>

#include "cohort/cohort.h"

namespace {

struct Flags {
  std::string mode = "fsdp";  // fsdp or ddp
  int64_t width = 2048;
  int64_t layers = 40;
  int64_t steps = 3;
  int64_t batch = 8;  // per rank
  double lr = 1e-4;
  int replicate = 1;  // HSDP's replica groups (1: plain FSDP)
  std::string checkpoint_dir;
};

// One batch per rank, every step (an epoch is one step), so the loss must
// fall: rank r's batch is drawn from a generator seeded with r.
class FixedBatch : public cohort::DataSource {
 public:
  FixedBatch(int64_t width, int64_t batch, int rank) {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(rank + 1);
    auto x = torch::randn({batch, width}, gen);
    batch_ = {x, torch::sin(x)};
  }
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return 1; }
  torch::data::Example<> batch(int64_t) override { return batch_; }

 private:
  torch::data::Example<> batch_;
};

int64_t bytes_of(const torch::Tensor& t) { return t.defined() ? t.numel() * t.element_size() : 0; }

// A /proc/self/status figure in MB: "VmHWM" (peak resident), "VmPeak"
// (peak address space, what ulimit -v limits), "VmData" (private writable
// memory now, what ulimit -d limits).
double status_mb(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) / 1024.0;
  }
  return -1;
}

// What this rank holds of the model and its training state.
void report(const cohort::DeviceMesh& mesh, const Flags& f, torch::nn::Module& model,
            torch::optim::AdamW& adamw, double first, double last) {
  int64_t params = 0, grads = 0, state = 0;
  for (const auto& p : model.parameters()) {
    params += bytes_of(p);
    grads += bytes_of(p.grad());
  }
  for (const auto& [key, s] : adamw.state()) {
    const auto& st = static_cast<const torch::optim::AdamWParamState&>(*s);
    state += bytes_of(st.exp_avg()) + bytes_of(st.exp_avg_sq()) + bytes_of(st.max_exp_avg_sq());
  }
  const double mb = 1024.0 * 1024.0;
  std::printf(
      "fsdp_train %s (mesh %s) rank %d/%d: loss %.5f -> %.5f; holds %.2f MB parameters, %.2f MB "
      "gradients, "
      "%.2f MB AdamW state; peak resident %.0f MB, peak address space %.0f MB, private "
      "writable %.0f MB\n",
      f.mode.c_str(), mesh.to_string().c_str(), mesh.rank(), mesh.size(), first, last, params / mb,
      grads / mb, state / mb, status_mb("VmHWM"), status_mb("VmPeak"), status_mb("VmData"));
  std::fflush(stdout);
}

int run(const Flags& f) {
  torch::set_num_threads(1);
  auto world = cohort::init();
  const bool fsdp = f.mode == "fsdp";
  if (!fsdp && f.mode != "ddp") throw cohort::InvalidArgument("--mode must be fsdp or ddp");
  const int n = world->size();
  if (f.replicate < 1 || n % f.replicate != 0 || (!fsdp && f.replicate != 1)) {
    throw cohort::InvalidArgument("--replicate must divide the world size (" + std::to_string(n) +
                                  ") and needs --mode fsdp");
  }
  // FSDP: 1-D ("shard") or HSDP's 2-D mesh; DDP: the replicas.
  auto mesh = !fsdp              ? cohort::init_device_mesh(world, {n}, {"dp"})
              : f.replicate == 1 ? cohort::init_device_mesh(world, {n}, {"shard"})
                                 : cohort::init_device_mesh(world, {f.replicate, n / f.replicate},
                                                            {"replicate", "shard"});
  torch::manual_seed(0);
  // FSDP: each block is sharded as soon as it is built, so the full model
  // never exists on a rank.
  torch::nn::Sequential blocks;
  for (int64_t l = 0; l < f.layers; ++l) {
    torch::nn::AnyModule linear(torch::nn::Linear(f.width, f.width));
    blocks->push_back(fsdp ? torch::nn::AnyModule(cohort::fully_shard(linear, mesh)) : linear);
    blocks->push_back(torch::nn::Tanh());
  }
  cohort::FullyShard sharded{nullptr};
  std::unique_ptr<cohort::DistributedDataParallel<torch::nn::Sequential>> ddp;
  std::shared_ptr<torch::nn::Module> model;
  if (fsdp) {
    sharded = cohort::fully_shard(blocks, mesh);
    model = sharded.ptr();
  } else {
    ddp = std::make_unique<cohort::DistributedDataParallel<torch::nn::Sequential>>(blocks, mesh);
    model = blocks.ptr();
  }
  torch::optim::AdamW adamw(model->parameters(), torch::optim::AdamWOptions(f.lr));
  cohort::TrainerOptions config;
  config.schedule.base_lr = f.lr;
  config.max_steps = f.steps;
  config.epochs = f.steps;
  config.progress = false;
  config.checkpoint_dir = f.checkpoint_dir;  // saved at the end of fit()
  cohort::Trainer trainer(
      fsdp ? cohort::TrainerWiring::fsdp(sharded, adamw) : cohort::TrainerWiring::ddp(*ddp, adamw),
      [&](const torch::data::Example<>& b) {
        auto out = fsdp ? sharded->forward(b.data) : ddp->forward(b.data);
        return torch::mse_loss(out, b.target);
      },
      config);
  FixedBatch data(f.width, f.batch, world->rank());
  const auto steps = trainer.fit(data);
  const double first = steps.front().loss, last = steps.back().loss;
  report(mesh, f, *model, adamw, first, last);
  cohort::finalize();
  return steps.size() < 2 || last < first ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"A Linear stack trained with FSDP or DDP through cohort::Trainer (cohortrun)."};
  Flags f;
  app.add_option("--mode", f.mode, "fsdp or ddp");
  app.add_option("--width", f.width, "features of every Linear")->check(CLI::PositiveNumber);
  app.add_option("--layers", f.layers, "Linear + tanh blocks")->check(CLI::PositiveNumber);
  app.add_option("--steps", f.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch", f.batch, "samples per rank and step")->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "AdamW learning rate");
  app.add_option("--replicate", f.replicate, "HSDP: replica groups (FSDP within each)");
  app.add_option("--checkpoint-dir", f.checkpoint_dir, "save a checkpoint there at the end");
  CLI11_PARSE(app, argc, argv);
  const char* rank = std::getenv("RANK");
  const std::string who = std::string("fsdp_train on rank ") + (rank ? rank : "0");
  try {
    return run(f);
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "%s: out of memory (std::bad_alloc)\n", who.c_str());
  } catch (const c10::Error& e) {
    // LibTorch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: ...".
    const std::string what = e.what_without_backtrace();
    const bool oom = what.find("can't allocate memory") != std::string::npos;
    std::fprintf(stderr, "%s: %s%s\n", who.c_str(), oom ? "out of memory: " : "",
                 what.substr(0, what.find('\n')).c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", who.c_str(), e.what());
  }
  return 1;
}
