// gpt: a character-level decoder-only transformer trained with tensor (--tp),
// pipeline (--pp), data (--dp), expert (--ep: a mixture-of-experts
// feed-forward every other block, the experts split over ep ranks) and
// context (--cp: ring attention over the zig-zag split of the sequence)
// parallelism on the fortunes corpus:
//
//   cohortrun -n 8 -- gpt --tp 2 --pp 2 --dp 2 --steps 300
//   cohortrun -n 4 -- gpt --dp 2 --ep 2
//   cohortrun -n 4 -- gpt --cp 2 --tp 2
//
// It trains through the Trainer (TrainerWiring::mesh): each step runs
// --microbatches micro-batches of the DP rank's slice of the global batch
// (one seed per step) through the stages with a pipeline schedule
// (--schedule gpipe, 1f1b, zbh1, or interleaved with --virtual-stages v:
// v model chunks per rank; one stage when pp and v are 1), clips by the
// global norm over the mesh and checkpoints into --checkpoint-dir (a
// distributed checkpoint); a rerun resumes from the newest checkpoint there,
// at the same or any other --tp, --pp, --dp, --ep, --cp and --microbatches
// (the same model and --batch-size). The mesh is (pp, dp, ep, cp, tp), TP
// fastest; the batch's rows are split over dp x ep, each sequence over cp. Rank 0 prints, logs the
// metrics and draws the curves.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
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
  int tp = 1, pp = 1, dp = 1, ep = 1, cp = 1;
  int64_t experts = 0;  // 0: 2 x ep when ep > 1, else dense blocks only
  int64_t top_k = 1;
  int64_t steps = 300;
  double max_grad_norm = 1.0;
  std::string checkpoint_dir = "gpt_checkpoints";
  int64_t checkpoint_every = 50;
  int64_t batch_size = 32;  // global
  int64_t seq_len = 64;
  int64_t hidden = 128;
  int64_t heads = 4;
  int64_t layers = 4;
  double lr = 3e-3;
  std::string schedule = "1f1b";  // pp > 1
  int microbatches = 4;           // per step and DP rank
  int virtual_stages = 1;         // model chunks per pipeline rank (interleaved)
  bool sequence_parallel = false;
  bool checkpoint_activations = false;
  bool untie_embeddings = false;  // the output layer a table of its own
  double dropout = 0.0;
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

// Forward only (evaluation, sampling): this rank's chunks in order of their
// pipeline stage k pp + pp_rank, each receiving the previous stage's
// activations (from the rank before, wrapping around between chunks) and
// sending its own on. Returns the last chunk's output (last stage: logits).
torch::Tensor run_stage(DeviceMesh& mesh, GPTStage& stage, const torch::Tensor& ids) {
  const auto& c = stage->config();
  auto& pp = *mesh["pp"].process_group();
  const int P = mesh.size("pp"), r = mesh.local_rank("pp"), chunks = P * stage->num_chunks();
  torch::Tensor out;
  for (int k = 0; k < stage->num_chunks(); ++k) {
    const int index = stage->chunk_index(k);
    torch::Tensor input = ids;
    if (index > 0 && P == 1) {
      // This rank's previous chunk: its output itself, which the stage's
      // experts know their micro-batch by (GPTStage::forward_chunk).
      input = out;
    } else if (index > 0) {
      const auto T = c.sequence_parallel ? c.seq_len / mesh.size("tp") : ids.size(1);
      input = torch::empty({T, ids.size(0), c.hidden});
      pp.recv(input, (r + P - 1) % P).wait();
    }
    out = stage->forward_chunk(k, input);
    if (index + 1 < chunks && P > 1) pp.send(out.detach().contiguous(), (r + 1) % P).wait();
  }
  return out;
}

bool is_last_stage(const DeviceMesh& mesh) { return mesh.local_rank("pp") == mesh.size("pp") - 1; }

// Mean over the dense group (dp x ep x cp) of a last-stage scalar (other
// stages return 0).
double dp_mean(DeviceMesh& mesh, cohort::Communicator& dense, const torch::Tensor& loss) {
  if (!is_last_stage(mesh)) return 0;
  auto l = loss.detach().reshape({1}).clone();
  dense.all_reduce(l, {cohort::ReduceOp::Avg}).wait();
  return l.item<double>();
}

// This rank's place among the ranks that read different rows (dp x ep).
int row_rank(const DeviceMesh& mesh) {
  return mesh.local_rank("dp") * mesh.size("ep") + mesh.local_rank("ep");
}

double validation_loss(DeviceMesh& mesh, cohort::Communicator& dense, GPTStage& stage,
                       const gpt::Corpus& corpus, const Flags& f) {
  torch::NoGradGuard no_grad;
  stage->eval();
  const auto rows = f.batch_size / (f.dp * f.ep);
  double sum = 0;
  for (int64_t i = 0; i < f.eval_batches; ++i) {
    auto [ids, targets] = draw_batch(corpus.validation, f.batch_size, f.seq_len, 1000 + i);
    ids = stage->local_sequence(ids.narrow(0, row_rank(mesh) * rows, rows));
    targets = stage->local_sequence(targets.narrow(0, row_rank(mesh) * rows, rows));
    auto out = run_stage(mesh, stage, ids);
    if (is_last_stage(mesh)) sum += dp_mean(mesh, dense, stage->loss(out, targets));
  }
  stage->train();
  // The last stage's mean, on every rank.
  auto mean = torch::tensor({sum / static_cast<double>(f.eval_batches)}, torch::kFloat64);
  mesh["pp"].process_group()->broadcast(mean, {mesh.size("pp") - 1}).wait();
  return mean.item<double>();
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
    auto out = run_stage(mesh, stage, stage->local_sequence(context));
    auto token = torch::zeros({1}, torch::kInt64);
    if (is_last_stage(mesh)) {
      // The last position is the last row of cp rank 0 (its late chunk).
      auto local = out[out.size(0) - 1][0].contiguous();  // [V/tp]
      auto full = torch::empty({local.size(0) * mesh.size("tp")});
      mesh["tp"].process_group()->all_gather_into_tensor(full, local).wait();
      token = torch::multinomial(torch::softmax(full / 0.8, 0), 1, false, gen);
      if (f.cp > 1) mesh["cp"].process_group()->broadcast(token, {0}).wait();
    }
    mesh["pp"].process_group()->broadcast(token, {mesh.size("pp") - 1}).wait();
    text += gpt::decode(token.item<int64_t>());
    context = torch::cat({context.narrow(1, 1, f.seq_len - 1), token.view({1, 1})}, 1);
  }
  stage->train();
  return text;
}

// Step s's global batch (drawn from one seed, s from 1), this dp x ep
// rank's rows of it (and under cp its columns), cut into m micro-batches. An epoch is as many steps
// as it takes to draw about as many characters as the text has (never fewer than 1, and independent
// of --steps, so a longer rerun continues the same epoch); micro-batch i of the epoch's step j
// belongs to step epoch * steps_per_epoch + j + 1. Every TP rank and stage of a replica reads the
// same.
class GptBatches : public cohort::DataSource {
 public:
  GptBatches(const torch::Tensor& text, const Flags& f, int row_rank, GPTStage stage)
      : text_(text), f_(f), dp_rank_(row_rank), m_(f.microbatches), stage_(std::move(stage)) {}
  int64_t steps_per_epoch() const {
    return std::max<int64_t>(1, text_.size(0) / (f_.batch_size * f_.seq_len));
  }
  void set_epoch(int64_t epoch) override { epoch_ = epoch; }
  int64_t num_batches() const override { return steps_per_epoch() * m_; }
  torch::data::Example<> batch(int64_t index) override {
    const auto [step, start, micro] = rows_of(index);
    auto [ids, targets] = draw_batch(text_, f_.batch_size, f_.seq_len, f_.seed * 7919 + step);
    return {stage_->local_sequence(ids.narrow(0, start, micro)),
            stage_->local_sequence(targets.narrow(0, start, micro))};
  }
  // Row r of step s's global batch is sample s * batch_size + r: by these
  // the cp ranks, which each hold other columns, show the Trainer that they
  // read the same rows.
  torch::Tensor sample_indices(int64_t index) override {
    const auto [step, start, micro] = rows_of(index);
    return torch::arange(micro, torch::kInt64) + step * f_.batch_size + start;
  }
  // A step's micro-batches over all DP ranks are its global batch, whatever
  // dp is: so a checkpoint (taken between steps) resumes at another layout.
  int64_t global_micro_batch() const override { return f_.batch_size / m_; }

 private:
  torch::Tensor text_;
  const Flags& f_;
  int dp_rank_;
  int64_t m_;
  GPTStage stage_;
  int64_t epoch_ = 0;

  struct Rows {
    int64_t step, start, micro;
  };
  // Micro-batch `index`'s step and its first row and row count in that
  // step's global batch.
  Rows rows_of(int64_t index) const {
    const int64_t step = epoch_ * steps_per_epoch() + index / m_ + 1, i = index % m_;
    const int64_t rows = f_.batch_size / (f_.dp * f_.ep), micro = rows / m_;
    return {step, dp_rank_ * rows + i * micro, micro};
  }
};

GPTConfig model_config(const Flags& f) {
  GPTConfig c;
  c.vocab_size = gpt::kVocabSize;
  c.seq_len = f.seq_len;
  c.hidden = f.hidden;
  c.heads = f.heads;
  c.layers = f.layers;
  c.virtual_stages = f.virtual_stages;
  c.sequence_parallel = f.sequence_parallel;
  c.checkpoint_activations = f.checkpoint_activations;
  c.tie_embeddings = !f.untie_embeddings;
  c.dropout = f.dropout;
  c.seed = f.seed;
  c.experts = f.experts > 0 ? f.experts : (f.ep > 1 ? 2 * f.ep : 0);
  c.top_k = f.top_k;
  return c;
}

cohort::TrainerOptions trainer_config(const Flags& f, int64_t steps_per_epoch) {
  cohort::TrainerOptions config;
  config.epochs = (f.steps + steps_per_epoch - 1) / steps_per_epoch;
  config.accumulation_steps = f.microbatches;
  config.max_grad_norm = f.max_grad_norm;
  config.schedule.base_lr = f.lr;
  config.max_steps = f.steps;
  config.checkpoint_dir = f.checkpoint_dir;
  config.checkpoint_every = f.checkpoint_every;
  config.metrics_path = f.metrics;
  config.log_every = f.eval_every;
  return config;
}

void check_sizes(const Flags& f) {
  if (f.batch_size % (static_cast<int64_t>(f.dp) * f.ep * f.microbatches) != 0) {
    throw cohort::InvalidArgument("gpt: --batch-size " + std::to_string(f.batch_size) +
                                  " does not divide by --dp x --ep x --microbatches " +
                                  std::to_string(f.dp * f.ep * f.microbatches));
  }
}

// The metrics file's curves: train loss and validation loss by step.
void plot(const Flags& f) {
  if (f.plot.empty() || f.metrics.empty()) return;
  try {
    auto curves = cohort_plot::read_metrics(f.metrics);
    curves.accuracy_key = "val_loss";
    curves.accuracy.clear();
    std::ifstream in(f.metrics);
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.contains("val_loss")) curves.accuracy.emplace_back(j["step"], j["val_loss"]);
    }
    cohort_plot::plot_metrics(curves, f.plot);
    std::printf("curves: %s\n", f.plot.c_str());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());  // the training result stands
  }
}

// Every parameter of the model once (TP shards, experts and stages summed
// over the world; DP and CP replicas, the copies of replicated parameters
// over ep and the tied copy left out): equal runs print equal sums.
double parameter_sum(DeviceMesh& mesh, GPTStage& stage) {
  double sum = 0;
  if (mesh.local_rank("dp") == 0 && mesh.local_rank("cp") == 0) {
    const auto tied = mesh.size("pp") > 1 && is_last_stage(mesh) ? stage->shared_embedding_weight()
                                                                 : torch::Tensor();
    std::set<const void*> experts;
    for (const auto& p : stage->expert_parameters()) experts.insert(p.unsafeGetTensorImpl());
    for (const auto& p : stage->parameters()) {
      if (tied.defined() && p.is_same(tied)) continue;
      if (mesh.local_rank("ep") != 0 && !experts.count(p.unsafeGetTensorImpl())) continue;
      sum += p.detach().to(torch::kFloat64).sum().item<double>();
    }
  }
  auto t = torch::tensor({sum}, torch::kFloat64);
  mesh.process_group()->all_reduce(t, {cohort::ReduceOp::Sum}).wait();
  return t.item<double>();
}

void summarize(const Flags& f, const std::vector<cohort::StepMetrics>& steps, double seconds,
               double params, const std::string& sample) {
  if (!steps.empty()) {
    std::map<std::string, double> bytes;
    for (const auto& m : steps)
      for (const auto& [dim, b] : m.comm_bytes_by_dimension) bytes[dim] += static_cast<double>(b);
    const auto n = static_cast<double>(steps.size());
    std::printf("tokens/s: %.0f (%zu steps in %.1f s, evaluation included)\n",
                n * static_cast<double>(f.batch_size * f.seq_len) / seconds, steps.size(), seconds);
    std::printf("sent by rank 0 per step: TP %.0f, PP %.0f, DP %.0f, EP %.0f, CP %.0f bytes\n",
                bytes["tp"] / n, bytes["pp"] / n, bytes["dp"] / n, bytes["ep"] / n,
                bytes["cp"] / n);
    std::printf("final train loss %.17g at step %lld\n", steps.back().loss,
                static_cast<long long>(steps.back().step));
  }
  std::printf("parameter sum: %.17g\n", params);
  std::printf("sample:\n%s\n", sample.c_str());
  plot(f);
  std::fflush(stdout);
}

int run(const Flags& f) {
  auto world = cohort::init();
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  torch::set_num_threads(static_cast<int>(std::max<unsigned>(1, cores / world->size())));
  auto mesh = cohort::init_device_mesh(world, {f.pp, f.dp, f.ep, f.cp, f.tp},
                                       {"pp", "dp", "ep", "cp", "tp"});
  check_sizes(f);
  const bool lead = world->rank() == 0;  // holds the loss after the Trainer's all-reduce
  const auto corpus = gpt::load_corpus(f.corpus);

  GPTStage stage(mesh, model_config(f));
  cohort::GradientSynchronizerOptions sync_options;
  sync_options.expert_parameters = stage->expert_parameters();
  sync_options.untied_embedding = f.untie_embeddings;
  cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                    stage->shared_embedding_weight(), sync_options);
  auto rt = make_gpt_pipeline(mesh, stage, f.schedule, f.microbatches);
  torch::optim::AdamW opt(rt->parameters(), torch::optim::AdamWOptions(f.lr).weight_decay(0));
  GptBatches source(corpus.train, f, row_rank(mesh), stage);
  const auto tied = f.untie_embeddings ? cohort::dcp::TiedNames{} : gpt_tied_parameters();
  cohort::Trainer trainer(cohort::TrainerWiring::mesh(mesh, *rt, opt, sync, tied),
                          trainer_config(f, source.steps_per_epoch()));
  if (auto step = trainer.resume(); step && lead) {
    std::printf("resumed from checkpoint at step %lld\n", static_cast<long long>(*step));
  }
  if (lead) {
    std::printf("gpt: %s, %lld train / %lld validation chars, global batch %lld x %lld\n",
                mesh.to_string().c_str(), static_cast<long long>(corpus.train.size(0)),
                static_cast<long long>(corpus.validation.size(0)),
                static_cast<long long>(f.batch_size), static_cast<long long>(f.seq_len));
  }
  cohort::FitCallbacks callbacks;
  callbacks.on_step = [&](const cohort::StepMetrics& m) {
    if (m.step % f.eval_every != 0 && m.step != f.steps) return;
    const double val = validation_loss(mesh, *sync.dense_group(), stage, corpus, f);
    trainer.log_eval({{"val_loss", val}});
    if (lead) {
      std::printf("step %lld: train loss %.4f, validation loss %.4f\n",
                  static_cast<long long>(m.step), m.loss, val);
      std::fflush(stdout);
    }
  };
  const auto t_start = std::chrono::steady_clock::now();
  const auto steps = trainer.fit(source, callbacks);
  const double total =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  const double params = parameter_sum(mesh, stage);
  const auto sample = generate(mesh, stage, corpus, f.sample_chars, f);
  if (lead) summarize(f, steps, total, params, sample);
  cohort::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "Character-level GPT with tensor, pipeline, data, expert and context parallelism (run it "
      "with cohortrun)."};
  Flags f;
  app.add_option("--tp", f.tp, "tensor-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--pp", f.pp, "pipeline-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--dp", f.dp, "data-parallel size")->check(CLI::PositiveNumber);
  app.add_option("--ep", f.ep, "expert-parallel size (a MoE feed-forward every other block)")
      ->check(CLI::PositiveNumber);
  app.add_option("--cp", f.cp, "context-parallel size (ring attention over sequence chunks)")
      ->check(CLI::PositiveNumber);
  app.add_option("--experts", f.experts, "experts per MoE block (0: 2 x ep when --ep > 1)");
  app.add_option("--top-k", f.top_k, "experts per token (1 or 2)");
  app.add_option("--steps", f.steps, "optimizer steps")->check(CLI::PositiveNumber);
  app.add_option("--max-grad-norm", f.max_grad_norm, "clip to this global norm (0: never)");
  app.add_option("--checkpoint-dir", f.checkpoint_dir,
                 "checkpoint folder, resumed from (empty: none)");
  app.add_option("--checkpoint-every", f.checkpoint_every, "steps between checkpoints");
  app.add_option("--batch-size", f.batch_size, "global batch (sequences)")
      ->check(CLI::PositiveNumber);
  app.add_option("--seq-len", f.seq_len, "context length")->check(CLI::PositiveNumber);
  app.add_option("--hidden", f.hidden, "model width")->check(CLI::PositiveNumber);
  app.add_option("--heads", f.heads, "attention heads")->check(CLI::PositiveNumber);
  app.add_option("--layers", f.layers, "transformer blocks")->check(CLI::PositiveNumber);
  app.add_option("--lr", f.lr, "AdamW learning rate");
  app.add_option("--schedule", f.schedule,
                 "pipeline schedule: gpipe, 1f1b, zbh1, or interleaved (with --virtual-stages)");
  app.add_option("--virtual-stages", f.virtual_stages,
                 "model chunks per pipeline rank (interleaved schedule)")
      ->check(CLI::PositiveNumber);
  app.add_option("--microbatches", f.microbatches, "micro-batches per step (the schedule's)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--sequence-parallel", f.sequence_parallel,
               "split LayerNorm/dropout regions by sequence");
  app.add_flag("--checkpoint-activations", f.checkpoint_activations,
               "keep only each block's input; recompute its activations in backward");
  app.add_flag("--untie-embeddings", f.untie_embeddings,
               "give the output layer weights of its own instead of the word embedding's");
  app.add_option("--dropout", f.dropout,
                 "attention, residual and embedding dropout (from each stage's RNG tracker)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--eval-every", f.eval_every, "steps between validation losses")
      ->check(CLI::PositiveNumber);
  app.add_option("--sample-chars", f.sample_chars, "characters to generate at the end");
  app.add_option("--corpus", f.corpus, "text files (default: three fortunes files)");
  app.add_option("--metrics", f.metrics, "JSON-lines metrics file");
  app.add_option("--plot", f.plot, "PNG of the loss curves (empty: none)");
  app.add_option("--seed", f.seed, "seed of the weights, the batches and the dropout streams");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(f);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gpt: %s\n", e.what());
    return 1;
  }
}
