// pipeline_mlp: trains an MLP split into one stage per rank (or v per rank
// with the interleaved schedule) to imitate a fixed random "teacher" MLP.
// Every rank builds and keeps only its own stages and steps an optimizer
// over their parameters; the loss comes from the last stage to every rank.
// The Trainer drives the pipeline: --clip clips by the global gradient norm
// over all stages, --checkpoint-dir saves every rank's stages and resumes
// from the newest checkpoint there. --checkpoint-activations keeps only
// each (Linear, Tanh) block's input and recomputes the block in backward.
//
// From the build folder:
//   tools/cohortrun/cohortrun -n 2 -- examples/pipeline/pipeline_mlp --schedule 1f1b --steps 200
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "cohort/cohort.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/train/trainer.h"

using namespace cohort::pipeline;

namespace {

struct Config {
  std::string schedule = "1f1b";  // gpipe, 1f1b, interleaved, zbh1
  int virtual_stages = 2;         // v, for the interleaved schedule
  int microbatches = 4;           // m
  int steps = 200;
  int64_t width = 64, batch = 64;
  int layers_per_stage = 2;
  double lr = 3e-3;
  double clip = 0;             // max global gradient norm; 0: no clipping
  std::string checkpoint_dir;  // empty: no checkpoints
  int checkpoint_every = 50;
  bool print_schedule = false;
  bool checkpoint_activations = false;
};

// Layers [s * L, (s + 1) * L) of the student: Linear + Tanh blocks, the last
// one Linear only. Seeded per layer, so that each rank builds just its own.
torch::nn::Sequential build_stage(const Config& c, int stage, int stages) {
  torch::nn::Sequential seq;
  for (int l = 0; l < c.layers_per_stage; ++l) {
    const int layer = stage * c.layers_per_stage + l;
    torch::manual_seed(1000 + layer);
    seq->push_back(torch::nn::Linear(c.width, c.width));
    if (!(stage == stages - 1 && l == c.layers_per_stage - 1)) seq->push_back(torch::nn::Tanh());
  }
  return seq;
}

// Micro-batch i: inputs drawn from a generator seeded with i, targets the
// teacher's outputs; the same on every rank, and the same after a resume.
class TeacherData : public cohort::DataSource {
 public:
  TeacherData(torch::nn::Sequential teacher, int64_t micro, int64_t width, int64_t batches)
      : teacher_(std::move(teacher)), micro_(micro), width_(width), batches_(batches) {}
  void set_epoch(int64_t) override {}
  int64_t num_batches() const override { return batches_; }
  torch::data::Example<> batch(int64_t index) override {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(1000003 + index));
    auto x = torch::randn({micro_, width_}, gen, torch::kFloat32);
    torch::NoGradGuard no_grad;
    return {x, teacher_->forward(x)};
  }

 private:
  torch::nn::Sequential teacher_;
  int64_t micro_, width_, batches_;
};

cohort::TrainerOptions trainer_config(const Config& c) {
  cohort::TrainerOptions config;
  config.accumulation_steps = c.microbatches;
  config.max_grad_norm = c.clip;
  config.schedule.base_lr = c.lr;
  config.max_steps = c.steps;
  config.checkpoint_dir = c.checkpoint_dir;
  config.checkpoint_every = c.checkpoint_every;
  config.progress = false;
  return config;
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"pipeline-parallel MLP training"};
  app.add_option("--schedule", c.schedule, "gpipe, 1f1b, interleaved or zbh1");
  app.add_option("--virtual-stages", c.virtual_stages, "v for the interleaved schedule");
  app.add_option("--microbatches", c.microbatches, "micro-batches per step (m)");
  app.add_option("--steps", c.steps, "optimizer steps");
  app.add_option("--width", c.width, "hidden width");
  app.add_option("--batch", c.batch, "samples per step");
  app.add_option("--lr", c.lr, "Adam learning rate");
  app.add_option("--clip", c.clip, "clip to this global gradient norm (0: off)");
  app.add_option("--checkpoint-dir", c.checkpoint_dir, "checkpoint here and resume from it");
  app.add_option("--checkpoint-every", c.checkpoint_every, "steps between checkpoints");
  app.add_flag("--print-schedule", c.print_schedule, "print the schedule's text form");
  app.add_flag("--checkpoint-activations", c.checkpoint_activations,
               "recompute each block's activations in backward instead of keeping them");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    const int pp = comm->size();
    auto mesh = cohort::init_device_mesh(comm, {pp}, {"pp"});
    const int v = c.schedule == "interleaved" ? c.virtual_stages : 1;
    auto schedule = make_schedule(c.schedule, pp, v, c.microbatches);
    if (c.print_schedule && comm->rank() == 0)
      std::printf("%s", format_schedule(add_communication(schedule)).c_str());
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(comm->rank()))
      mine.emplace_back(s, c.checkpoint_activations
                               ? cohort::checkpoint_blocks(build_stage(c, s, schedule.num_stages))
                               : build_stage(c, s, schedule.num_stages));
    auto mse = [](const Tensors& out, const Tensors& y) {
      return torch::nn::functional::mse_loss(out[0], y[0]);
    };
    PipelineRuntime rt(mesh["pp"], std::move(mine), schedule, mse);
    torch::optim::Adam opt(rt.parameters(), torch::optim::AdamOptions(c.lr));

    torch::manual_seed(7);  // the teacher: the same on every rank
    torch::nn::Sequential teacher(torch::nn::Linear(c.width, c.width), torch::nn::Tanh(),
                                  torch::nn::Linear(c.width, c.width));
    TeacherData data(teacher, c.batch / c.microbatches, c.width, int64_t{c.steps} * c.microbatches);
    cohort::Trainer trainer(cohort::TrainerWiring::pipeline(rt, opt), trainer_config(c));
    const auto resumed = trainer.resume();
    if (resumed && comm->rank() == 0) std::printf("resumed from step %lld\n", (long long)*resumed);
    cohort::FitCallbacks callbacks;
    callbacks.on_step = [&](const cohort::StepMetrics& m) {
      if (comm->rank() == 0 && (m.step % 20 == 1 || m.step == c.steps))
        std::printf("step %4lld  loss %.5f  norm %.3f%s  (%.1f ms, %s, pp %d, v %d, m %d)\n",
                    (long long)m.step, m.loss, m.grad_norm, m.clipped ? " clipped" : "",
                    m.step_seconds * 1e3, schedule.name.c_str(), pp, v, c.microbatches);
    };
    const auto metrics = trainer.fit(data, callbacks);
    // The check the test command relies on: the student learns.
    if (!resumed && metrics.size() > 1 && !(metrics.back().loss < 0.5 * metrics.front().loss)) {
      std::fprintf(stderr, "pipeline_mlp: the loss did not halve (%.5f -> %.5f)\n",
                   metrics.front().loss, metrics.back().loss);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_mlp: %s\n", e.what());
    return 1;
  }
  return 0;
}
