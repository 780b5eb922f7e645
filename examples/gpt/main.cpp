// gpt: a character-level decoder-only transformer trained with tensor (--tp),
// pipeline (--pp) and data (--dp) parallelism on the fortunes corpus:
//
//   cohortrun -n 8 -- gpt --tp 2 --pp 2 --dp 2
//
// Every rank draws the same global batch (one seed per step) and keeps its
// DP slice. With pp > 1 each step runs --microbatches micro-batches through
// the stages with a pipeline schedule (--schedule gpipe, 1f1b or zbh1). The
// last stage's first rank prints, logs the metrics and draws the curves.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <thread>

#include "cohort/cohort.h"
#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/schedule.h"
#include "cohort/train/metrics_log.h"
#include "corpus.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "plot_metrics.h"

namespace {

using cohort::DeviceMesh;
using namespace cohort::tensor_parallel;

struct Flags {
  int tp = 1, pp = 1, dp = 1;
  int64_t steps = 300;
  int64_t batch_size = 32;  // global
  int64_t seq_len = 64;
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t layers = 4;
  double lr = 3e-3;
  std::string schedule = "1f1b";  // pp > 1
  int microbatches = 4;           // pp > 1
  bool sequence_parallel = false;
  bool checkpoint_activations = false;
  int64_t eval_every = 50;
  int64_t eval_batches = 4;
  int64_t sample_chars = 300;
  std::vector<std::string> corpus = {std::string(gpt::kFortunesDir) + "/computers",
                                     std::string(gpt::kFortunesDir) + "/science",
                                     std::string(gpt::kFortunesDir) + "/wisdom"};
  std::string metrics = "gpt_metrics.jsonl";
  std::string plot = "gpt_curves.png";
  uint64_t seed = 0;
};

// `rows` windows of `T` + 1 characters at offsets drawn from `seed`.
std::pair<torch::Tensor, torch::Tensor> draw_batch(const torch::Tensor& text, int64_t rows,
                                                   int64_t T, uint64_t seed) {
  auto offsets = torch::randint(text.size(0) - T - 1, {rows}, at::detail::createCPUGenerator(seed));
  std::vector<torch::Tensor> windows;
  for (int64_t i = 0; i < rows; ++i)
    windows.push_back(text.narrow(0, offsets[i].item<int64_t>(), T + 1));
  auto w = torch::stack(windows);
  return {w.narrow(1, 0, T), w.narrow(1, 1, T)};
}

// Forward only (evaluation, sampling): receives the previous stage's
// activations and sends this stage's on. Returns the stage output (last
// stage: logits).
torch::Tensor run_stage(DeviceMesh& mesh, GPTStage& stage, const torch::Tensor& ids) {
  const auto& c = stage->config();
  auto& pp = *mesh.pp_group();
  torch::Tensor input = ids;
  if (!mesh.is_pp_first()) {
    const auto T = c.sequence_parallel ? c.seq_len / mesh.tp_size() : c.seq_len;
    input = torch::empty({T, ids.size(0), c.hidden});
    pp.recv(input, mesh.pp_rank() - 1).wait();
  }
  auto out = stage(input);
  if (!mesh.is_pp_last()) pp.send(out.detach().contiguous(), mesh.pp_rank() + 1).wait();
  return out;
}

// Mean over DP of a last-stage scalar (other stages return 0).
double dp_mean(DeviceMesh& mesh, const torch::Tensor& loss) {
  if (!mesh.is_pp_last()) return 0;
  auto l = loss.detach().reshape({1}).clone();
  mesh.dp_group()->all_reduce(l, {cohort::ReduceOp::Avg}).wait();
  return l.item<double>();
}

double validation_loss(DeviceMesh& mesh, GPTStage& stage, const gpt::Corpus& corpus,
                       const Flags& f) {
  torch::NoGradGuard no_grad;
  stage->eval();
  const auto rows = f.batch_size / f.dp;
  double sum = 0;
  for (int64_t i = 0; i < f.eval_batches; ++i) {
    auto [ids, targets] = draw_batch(corpus.validation, f.batch_size, f.seq_len, 1000 + i);
    ids = ids.narrow(0, mesh.dp_rank() * rows, rows);
    targets = targets.narrow(0, mesh.dp_rank() * rows, rows);
    auto out = run_stage(mesh, stage, ids);
    if (mesh.is_pp_last()) sum += dp_mean(mesh, stage->loss(out, targets));
  }
  stage->train();
  return sum / static_cast<double>(f.eval_batches);
}

// Samples `n` characters after a prompt from the validation text; every
// rank takes part (the last stage samples, then broadcasts each token).
std::string generate(DeviceMesh& mesh, GPTStage& stage, const gpt::Corpus& corpus, int64_t n,
                     const Flags& f) {
  torch::NoGradGuard no_grad;
  stage->eval();
  auto context = corpus.validation.narrow(0, 0, f.seq_len).clone().unsqueeze(0);  // [1, T]
  auto gen = at::detail::createCPUGenerator(f.seed + 99);
  std::string text;
  for (int64_t i = 0; i < n; ++i) {
    auto out = run_stage(mesh, stage, context);
    auto token = torch::zeros({1}, torch::kInt64);
    if (mesh.is_pp_last()) {
      auto local = out[f.seq_len - 1][0].contiguous();  // [V/tp]
      auto full = torch::empty({local.size(0) * mesh.tp_size()});
      mesh.tp_group()->all_gather_into_tensor(full, local).wait();
      token = torch::multinomial(torch::softmax(full / 0.8, 0), 1, false, gen);
    }
    mesh.pp_group()->broadcast(token, {mesh.pp_size() - 1}).wait();
    text += gpt::decode(token.item<int64_t>());
    context = torch::cat({context.narrow(1, 1, f.seq_len - 1), token.view({1, 1})}, 1);
  }
  stage->train();
  return text;
}

int run(const Flags& f) {
  auto world = cohort::init();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  torch::set_num_threads(static_cast<int>(std::max<unsigned>(1, cores / world->size())));
  auto mesh = std::make_shared<DeviceMesh>(world, cohort::MeshShape{f.dp, f.pp, f.tp});
  if (f.batch_size % f.dp != 0) {
    throw cohort::InvalidArgument("gpt: --batch-size " + std::to_string(f.batch_size) +
                                  " does not divide by --dp " + std::to_string(f.dp));
  }
  const bool lead = mesh->is_pp_last() && mesh->tp_rank() == 0 && mesh->dp_rank() == 0;
  const auto corpus = gpt::load_corpus(f.corpus);

  GPTConfig c;
  c.vocab_size = gpt::kVocabSize;
  c.seq_len = f.seq_len;
  c.hidden = f.hidden;
  c.heads = f.heads;
  c.layers = f.layers;
  c.sequence_parallel = f.sequence_parallel;
  c.checkpoint_activations = f.checkpoint_activations;
  c.seed = f.seed;
  GPTStage stage(*mesh, c);
  GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                            stage->shared_embedding_weight());
  std::unique_ptr<cohort::pipeline::PipelineRuntime> rt;
  if (f.pp > 1) {
    rt = std::make_unique<cohort::pipeline::PipelineRuntime>(
        mesh->pp_group(),
        std::vector<cohort::pipeline::PipelineStage>{gpt_pipeline_stage(*mesh, stage)},
        cohort::pipeline::make_schedule(f.schedule, f.pp, 1, f.microbatches),
        gpt_pipeline_loss(stage));
  }
  torch::optim::AdamW opt(stage->parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0));
  cohort::MetricsLog log(f.metrics, lead);
  cohort_plot::Curves curves;
  curves.accuracy_key = "val_loss";
  if (lead) {
    std::printf("gpt: %s, %lld train / %lld validation chars, global batch %lld x %lld\n",
                mesh->shape().to_string().c_str(), static_cast<long long>(corpus.train.size(0)),
                static_cast<long long>(corpus.validation.size(0)),
                static_cast<long long>(f.batch_size), static_cast<long long>(f.seq_len));
  }
  const auto rows = f.batch_size / f.dp;
  const auto t_start = std::chrono::steady_clock::now();
  for (int64_t step = 1; step <= f.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    auto [ids, targets] = draw_batch(corpus.train, f.batch_size, f.seq_len, f.seed * 7919 + step);
    ids = ids.narrow(0, mesh->dp_rank() * rows, rows);
    targets = targets.narrow(0, mesh->dp_rank() * rows, rows);
    opt.zero_grad();
    torch::Tensor loss;
    if (rt) {
      auto r = rt->step({ids}, {targets});
      sync.synchronize();
      loss = torch::tensor(r.loss);
    } else {  // one stage: the DP reduction overlaps backward
      sync.prepare_forward();
      loss = stage->loss(stage(ids), targets);
      sync.after_forward({loss});
      loss.backward();
      sync.finish_backward();
    }
    opt.step();
    const double train_loss = dp_mean(*mesh, loss);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (lead) {
      cohort::StepMetrics m;
      m.step = step;
      m.loss = train_loss;
      m.lr = f.lr;
      m.samples = f.batch_size;
      m.step_seconds = seconds;
      m.samples_per_s = f.batch_size / seconds;
      log.append(cohort::to_json(m));
      curves.loss.emplace_back(step, train_loss);
    }
    if (step % f.eval_every == 0 || step == f.steps) {
      const double val = validation_loss(*mesh, stage, corpus, f);
      if (lead) {
        log.append({{"kind", "eval"}, {"step", step}, {"val_loss", val}});
        curves.accuracy.emplace_back(step, val);
        std::printf("step %lld: train loss %.4f, validation loss %.4f\n",
                    static_cast<long long>(step), train_loss, val);
        std::fflush(stdout);
      }
    }
  }
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  const auto sample = generate(*mesh, stage, corpus, f.sample_chars, f);
  if (lead) {
    const auto& s = sync.stats();
    std::printf("tokens/s: %.0f (%lld steps in %.1f s, evaluation included)\n",
                f.steps * f.batch_size * f.seq_len / total, static_cast<long long>(f.steps), total);
    std::printf(
        "gradient sync on this rank, per step: TP %.2f ms (%lld ops, %lld bytes), "
        "PP %.2f ms (%lld ops, %lld bytes), DP %.2f ms (%lld buckets, %lld bytes)\n",
        1e3 * s.tp.seconds / s.steps, static_cast<long long>(s.tp.ops / s.steps),
        static_cast<long long>(s.tp.bytes / s.steps), 1e3 * s.pp.seconds / s.steps,
        static_cast<long long>(s.pp.ops / s.steps), static_cast<long long>(s.pp.bytes / s.steps),
        1e3 * s.dp.seconds / s.steps, static_cast<long long>(s.dp.ops / s.steps),
        static_cast<long long>(s.dp.bytes / s.steps));
    std::printf("sample:\n%s\n", sample.c_str());
    if (!f.plot.empty()) {
      try {
        cohort_plot::plot_metrics(curves, f.plot);
        std::printf("curves: %s\n", f.plot.c_str());
      } catch (const cohort_plot::PlotError& e) {
        std::fprintf(stderr, "%s\n", e.what());
      }
    }
    std::fflush(stdout);
  }
  cohort::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Character-level GPT with tensor, pipeline and data parallelism (run it with cohortrun)."};
  Flags f;
  app.add_option("--tp", f.tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--pp", f.pp, "pipeline-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--dp", f.dp, "data-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--steps", f.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--batch-size", f.batch_size, "global batch (sequences)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seq-len", f.seq_len, "context length")->check(CLI::PositiveNumber);
  app.add_option("--hidden", f.hidden, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", f.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--layers", f.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "AdamW learning rate");
  app.add_option("--schedule", f.schedule, "pipeline schedule with pp > 1: gpipe, 1f1b or zbh1");
  app.add_option("--microbatches", f.microbatches, "micro-batches per step with pp > 1")
      ->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", f.sequence_parallel,
               "split LayerNorm/dropout regions by sequence");
  app.add_flag("--checkpoint-activations", f.checkpoint_activations,
               "keep only each block's input; recompute its activations in backward");
  app.add_option("--eval-every", f.eval_every, "steps between validation losses")
      ->check(CLI::PositiveNumber);
  app.add_option("--sample-chars", f.sample_chars, "characters to generate at the end");
  app.add_option("--corpus", f.corpus, "text files (default: three fortunes files)");
  app.add_option("--metrics", f.metrics, "JSON-lines metrics file");
  app.add_option("--plot", f.plot, "PNG of the loss curves (empty: none)");
  app.add_option("--seed", f.seed, "seed of the weights and the batches");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: %s\n", e.what());
    return 1;
  }
}
