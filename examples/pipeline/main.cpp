// pipeline_mlp: trains an MLP split into one stage per rank (or v per rank
// with the interleaved schedule) to imitate a fixed random "teacher" MLP.
// Every rank builds and keeps only its own stages and steps an optimizer
// over their parameters; the loss comes from the last stage to every rank.
//
//   build/tools/cohortrun/cohortrun -n 2 -- build/examples/pipeline/pipeline_mlp \
//       --schedule 1f1b --microbatches 4 --steps 200
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>

#include "cohort/cohort.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/schedule_validator.h"

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
  bool print_schedule = false;
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
  app.add_flag("--print-schedule", c.print_schedule, "print the schedule's text form");
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    const int pp = comm->size();
    const int v = c.schedule == "interleaved" ? c.virtual_stages : 1;
    auto schedule = make_schedule(c.schedule, pp, v, c.microbatches);
    if (c.print_schedule && comm->rank() == 0)
      std::printf("%s", format_schedule(add_communication(schedule)).c_str());
    std::vector<PipelineStage> mine;
    for (int s : schedule.stages_of(comm->rank()))
      mine.emplace_back(s, build_stage(c, s, schedule.num_stages));
    auto mse = [](const Tensors& out, const Tensors& y) {
      return torch::nn::functional::mse_loss(out[0], y[0]);
    };
    PipelineRuntime rt(comm, std::move(mine), schedule, mse);
    torch::optim::Adam opt(rt.parameters(), torch::optim::AdamOptions(c.lr));

    torch::manual_seed(7);  // the teacher and the data: the same on every rank
    torch::nn::Sequential teacher(torch::nn::Linear(c.width, c.width), torch::nn::Tanh(),
                                  torch::nn::Linear(c.width, c.width));
    double first_loss = 0, last_loss = 0;
    for (int step = 0; step < c.steps; ++step) {
      torch::Tensor x = torch::randn({c.batch, c.width}), y;
      {
        torch::NoGradGuard g;
        y = teacher->forward(x);
      }
      opt.zero_grad();
      auto r = rt.step({x}, {y});
      opt.step();
      (step == 0 ? first_loss : last_loss) = r.loss;
      if (comm->rank() == 0 && (step % 20 == 0 || step == c.steps - 1))
        std::printf("step %4d  loss %.5f  (%.1f ms, %s, pp %d, v %d, m %d)\n", step, r.loss,
                    r.step_ms, schedule.name.c_str(), pp, v, c.microbatches);
    }
    // The check the test command relies on: the student learns.
    if (c.steps > 1 && !(last_loss < 0.5 * first_loss)) {
      std::fprintf(stderr, "pipeline_mlp: the loss did not halve (%.5f -> %.5f)\n", first_loss,
                   last_loss);
      return 1;
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_mlp: %s\n", e.what());
    return 1;
  }
  return 0;
}
