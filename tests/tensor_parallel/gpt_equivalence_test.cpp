// Mesh equivalence: the GPT trained ten steps at (tp, pp, dp, cp), with and
// without sequence parallelism, against the same model in one process on the
// global batch: every step's loss (every last-stage rank's) and, at the end,
// every parameter (each shard against the matching slice of the reference)
// within 1e-5 relative.
// Tied embeddings train with SGD; untied ones (the output layer a table of
// its own, GradientSynchronizerOptions::untied_embedding) with AdamW.
//
// pp > 1 (or v > 1 model chunks per rank, interleaved) runs each step
// through the pipeline's schedules (PipelineRuntime over the mesh's PP
// group, the batch split into micro-batches) and
// GradientSynchronizer::synchronize; pp = 1 through forward, backward and
// the DP reducer overlapped with it.
//
// Context parallelism (cp > 1) splits each sequence into its zig-zag chunks
// (GPTStage::local_sequence, seq_len 8) and runs ring attention over "cp",
// inside every pipeline stage; the cases with it also ignore some targets
// (-100), so that cp ranks and micro-batches hold different numbers of
// counted tokens, and some checkpoint each block's activations (recomputing
// the ring in backward, under every schedule's split of it). The loss is
// the mean of the micro-batches' means (each the mean over its sequences'
// counted tokens, whole across cp), the dp ranks' mean of those: the
// reference runs the same row blocks one after another, loss / blocks.
//
// With COHORT_TEST_DEVICE=cuda the stages, the batches and the one-process
// reference live on the GPU.
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "cohort/mesh/gradient_synchronizer.h"
#include "cohort/pipeline/schedule.h"
#include "examples/models/gpt_model.h"
#include "examples/models/gpt_pipeline.h"
#include "support/rank_errors.h"
#include "support/test_device.h"
#include "support/thread_ranks.h"

namespace cohort::testing::gpt_equivalence_test {
namespace {

using namespace cohort::tensor_parallel;

constexpr int kSteps = 10;
constexpr int64_t kBatch = 4;  // global

struct Case {
  int tp, pp, dp;
  bool sp;
  const char* schedule = "1f1b";  // pp > 1
  int microbatches = 2;           // pp > 1; divides kBatch / dp
  int v = 1;                      // model chunks per PP rank (interleaved)
  // pp = 1: micro-batches per step, the first accumulate - 1 under
  // no_sync(), finish_backward() after each; `reducer_guard`: the DP
  // reducer's NoSyncGuard instead of the synchronizer's no_sync().
  int accumulate = 1;
  bool reducer_guard = false;
  bool untied = false;  // the output layer's own table, trained with AdamW
  int cp = 1;
  bool ignored = false;     // some targets -100 (every row's tail, one more in row 1)
  bool checkpoint = false;  // GPTConfig::checkpoint_activations
  int64_t seq_len = 6;      // divides by 2 cp (zig-zag) and by tp under sp
};

// `k` at context parallelism cp (seq_len 8), its targets partly ignored.
Case context_case(Case k, int cp, bool checkpoint = false) {
  k.cp = cp;
  k.seq_len = 8;
  k.ignored = true;
  k.checkpoint = checkpoint;
  return k;
}

// `k` with untied embeddings.
Case untied_case(Case k) {
  k.untied = true;
  return k;
}

bool pipelined(const Case& k) { return k.pp > 1 || k.v > 1; }

// Interleaved cases cut the model into pp * v chunks, so they train (and
// their reference has) four layers.
GPTConfig config(bool sp, int v = 1, int64_t layers = 2, bool tied = true, int64_t seq_len = 6) {
  GPTConfig c;
  c.tie_embeddings = tied;
  c.vocab_size = 12;
  c.seq_len = seq_len;
  c.hidden = 24;
  c.heads = 6;
  c.layers = layers;
  c.virtual_stages = v;
  c.sequence_parallel = sp;
  c.seed = 7;
  return c;
}

// Step s's global batch: random ids and targets that are a fixed function of
// them (learnable, so that the loss falls within ten steps), [kBatch, T].
// `ignored`: the last two positions of every row (at cp 2 rank 0's, so it
// counts half the tokens rank 1 does) and one more per step in row 1 (so the
// micro-batches count different numbers) are -100.
std::pair<torch::Tensor, torch::Tensor> batch(int s, const GPTConfig& c, bool ignored = false) {
  auto ids =
      torch::randint(c.vocab_size, {kBatch, c.seq_len}, at::detail::createCPUGenerator(100 + s));
  auto targets = (ids * 5 + 3) % c.vocab_size;
  if (ignored) {
    targets.narrow(1, c.seq_len - 2, 2).fill_(-100);
    targets[1][(2 + s) % (c.seq_len - 2)] = -100;
  }
  return {ids, targets};
}

int64_t layers_of(const Case& k) { return k.v > 1 ? 4 : 2; }

struct Result {
  std::vector<std::vector<double>> losses;      // every last-stage rank's global mean per step
  std::map<std::string, torch::Tensor> params;  // name -> value at the end
};

// One training step of one rank without a pipeline, in `accumulate`
// micro-batches (header recipe of GradientSynchronizer); returns the loss.
torch::Tensor step(GPTStage& stage, cohort::GradientSynchronizer& sync,
                   torch::optim::Optimizer& opt, const torch::Tensor& ids,
                   const torch::Tensor& targets, int accumulate = 1, bool reducer_guard = false) {
  opt.zero_grad();
  const int64_t rows = ids.size(0) / accumulate;
  auto total = torch::zeros({}, ids.options().dtype(torch::kFloat32));
  for (int m = 0; m < accumulate; ++m) {
    std::optional<cohort::GradientSynchronizer::NoSync> local;
    std::optional<NoSyncGuard> reducer_local;
    if (m + 1 < accumulate) {
      if (reducer_guard) {
        reducer_local.emplace(*sync.dp_reducer());
      } else {
        local.emplace(sync.no_sync());
      }
    }
    sync.prepare_forward();
    auto loss =
        stage->loss(stage(ids.narrow(0, m * rows, rows)), targets.narrow(0, m * rows, rows)) /
        accumulate;
    sync.after_forward({loss});
    loss.backward();
    sync.finish_backward();
    total = total + loss.detach();
  }
  opt.step();
  return total;
}

bool is_last_stage(const DeviceMesh& mesh) { return mesh.local_rank("pp") == mesh.size("pp") - 1; }

// One step through the pipeline; returns the batch's loss on the last stage
// (undefined elsewhere).
torch::Tensor step(DeviceMesh& mesh, pipeline::PipelineRuntime& rt,
                   cohort::GradientSynchronizer& sync, torch::optim::Optimizer& opt,
                   const torch::Tensor& ids, const torch::Tensor& targets) {
  opt.zero_grad();
  auto r = rt.step({ids}, {targets});
  sync.synchronize();
  opt.step();
  return is_last_stage(mesh) ? torch::tensor(r.loss, torch::kFloat64) : torch::Tensor();
}

std::unique_ptr<torch::optim::Optimizer> optimizer(const Case& k, GPTStage& stage) {
  if (k.untied) {
    // eps well above rounding: the key bias's gradient is zero in exact
    // arithmetic (softmax ignores a shift of every score of a query), so at
    // eps 1e-8 Adam would scale its rounding noise, which differs with the
    // order of any sum, into steps of lr.
    return std::make_unique<torch::optim::AdamW>(
        stage->parameters(), torch::optim::AdamWOptions(3e-3).weight_decay(0.1).eps(1e-4));
  }
  return std::make_unique<torch::optim::SGD>(stage->parameters(),
                                             torch::optim::SGDOptions(0.05).momentum(0.9));
}

DeviceMesh mesh_of(std::shared_ptr<Communicator> world, const Case& k) {
  if (k.cp == 1) return init_device_mesh(std::move(world), {k.pp, k.dp, k.tp}, {"pp", "dp", "tp"});
  return init_device_mesh(std::move(world), {k.pp, k.dp, k.cp, k.tp}, {"pp", "dp", "cp", "tp"});
}

Result train(const Case& k, int64_t layers) {
  Result result;
  std::mutex mu;
  run_ranks_shared(k.tp * k.pp * k.dp * k.cp, [&](std::shared_ptr<Communicator> world) {
    torch::set_num_threads(1);
    auto mesh = mesh_of(world, k);
    auto c = config(k.sp, k.v, layers, !k.untied, k.seq_len);
    c.checkpoint_activations = k.checkpoint;
    GPTStage stage(mesh, c);
    stage->to(test_device());  // before the synchronizer and the pipeline take its parameters
    cohort::GradientSynchronizerOptions so;
    so.untied_embedding = k.untied;
    cohort::GradientSynchronizer sync(mesh, stage.ptr(), stage->sequence_parallel_parameters(),
                                      stage->shared_embedding_weight(), so);
    auto optim = optimizer(k, stage);
    auto& opt = *optim;
    std::unique_ptr<pipeline::PipelineRuntime> rt;
    if (pipelined(k)) rt = make_gpt_pipeline(mesh, stage, k.schedule, k.microbatches);
    const auto rows = kBatch / k.dp;
    std::vector<double> losses;
    for (int s = 0; s < kSteps; ++s) {
      auto [ids, targets] = batch(s, c, k.ignored);
      const auto first = mesh.local_rank("dp") * rows;
      ids = stage->local_sequence(ids.narrow(0, first, rows)).to(test_device());
      targets = stage->local_sequence(targets.narrow(0, first, rows)).to(test_device());
      auto loss = rt ? step(mesh, *rt, sync, opt, ids, targets)
                     : step(stage, sync, opt, ids, targets, k.accumulate, k.reducer_guard);
      if (loss.defined()) {
        auto l = loss.detach().clone();
        mesh["dp"].process_group()->all_reduce(l, {ReduceOp::Avg}).wait();
        losses.push_back(l.item<double>());
      }
    }
    std::lock_guard<std::mutex> lock(mu);
    if (is_last_stage(mesh)) result.losses.push_back(losses);
    // Keyed by name and coordinates, so each shard can be found.
    for (const auto& p : stage->named_parameters()) {
      auto name = !k.untied && p.key() == "output_embeddings.weight" ? "word_embeddings.weight#last"
                                                                     : p.key();
      result.params[name + "@tp" + std::to_string(mesh.local_rank("tp")) + "dp" +
                    std::to_string(mesh.local_rank("dp")) + "cp" +
                    std::to_string(k.cp > 1 ? mesh.local_rank("cp") : 0)] =
          p.value().detach().clone();
    }
  });
  return result;
}

// The slice of `full` that a rank holding `shard`'s shape at tp_rank keeps.
torch::Tensor matching_slice(const torch::Tensor& full, const torch::Tensor& shard, int tp,
                             int tp_rank) {
  auto out = full;
  for (int64_t d = 0; d < full.dim(); ++d) {
    if (full.size(d) != shard.size(d)) {
      EXPECT_EQ(full.size(d), tp * shard.size(d));
      out = out.narrow(d, tp_rank * shard.size(d), shard.size(d));
    }
  }
  return out;
}

double relative_diff(const torch::Tensor& got, const torch::Tensor& want) {
  const double scale = std::max(want.abs().max().item<double>(), 1e-12);
  return (got - want).abs().max().item<double>() / scale;
}

// The one-process run of k's model (each trained once). With ignored
// targets the row blocks of k's losses (dp ranks x micro-batches) count
// different tokens, so it accumulates them one after another, loss / blocks;
// otherwise it takes the global batch at once.
const Result& reference(const Case& k) {
  const int blocks = !k.ignored ? 1 : k.dp * (pipelined(k) ? k.microbatches : k.accumulate);
  static std::map<std::tuple<int64_t, bool, int64_t, bool, int>, Result> runs;
  const auto key = std::make_tuple(layers_of(k), k.untied, k.seq_len, k.ignored, blocks);
  auto it = runs.find(key);
  if (it == runs.end()) {
    Case one{1, 1, 1, false};
    one.untied = k.untied;
    one.seq_len = k.seq_len;
    one.ignored = k.ignored;
    one.accumulate = blocks;
    it = runs.emplace(key, train(one, layers_of(k))).first;
  }
  return it->second;
}

class GPTEquivalence : public ::testing::TestWithParam<Case> {};

TEST_P(GPTEquivalence, TenStepsMatchSingleProcess) {
  const auto k = GetParam();
  const auto& ref = reference(k);
  ASSERT_EQ(ref.losses.size(), 1u);
  const auto& want_losses = ref.losses[0];
  ASSERT_EQ(want_losses.size(), static_cast<size_t>(kSteps));
  // Training must have moved: otherwise equality would prove nothing. (Each
  // step's batch is new; at four layers with ignored targets the tenth's
  // loss lies above the first's.)
  ASSERT_GT(std::abs(want_losses.back() - want_losses.front()), 0.05);

  const auto got = train(k, layers_of(k));
  ASSERT_EQ(got.losses.size(), static_cast<size_t>(k.tp * k.dp * k.cp));  // last-stage ranks
  for (const auto& losses : got.losses) {
    ASSERT_EQ(losses.size(), static_cast<size_t>(kSteps));
    for (int s = 0; s < kSteps; ++s) {
      EXPECT_LE(std::abs(losses[s] - want_losses[s]) / std::abs(want_losses[s]), 1e-5)
          << "step " << s << ": " << losses[s] << " vs " << want_losses[s];
    }
  }
  int compared = 0;
  for (const auto& [key, value] : got.params) {
    const auto at = key.find('@');
    auto name = key.substr(0, at);
    if (name == "word_embeddings.weight#last") name = "word_embeddings.weight";
    const int tp_rank = key[at + 3] - '0';
    auto it = ref.params.find(name + "@tp0dp0cp0");
    ASSERT_NE(it, ref.params.end()) << name;
    const auto want = matching_slice(it->second, value, k.tp, tp_rank);
    EXPECT_LE(relative_diff(value, want), 1e-5) << key;
    ++compared;
  }
  // A tied model at pp > 1 has the last stage's copy of the word embedding besides.
  const int copies = k.pp > 1 && !k.untied ? k.tp * k.dp * k.cp : 0;
  EXPECT_EQ(compared, static_cast<int>(ref.params.size()) * k.tp * k.dp * k.cp + copies);
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto& k = info.param;
  return "tp" + std::to_string(k.tp) + "_pp" + std::to_string(k.pp) + "_dp" + std::to_string(k.dp) +
         (k.sp ? "_sp" : "") +
         (pipelined(k) ? std::string("_") + k.schedule + "_m" + std::to_string(k.microbatches)
                       : "") +
         (k.v > 1 ? "_v" + std::to_string(k.v) : "") +
         (k.accumulate > 1 ? "_accumulate" + std::to_string(k.accumulate) : "") +
         (k.reducer_guard ? "_reducer_guard" : "") + (k.untied ? "_untied_adamw" : "") +
         (k.cp > 1 ? "_cp" + std::to_string(k.cp) : "") + (k.ignored ? "_ignored" : "") +
         (k.checkpoint ? "_checkpointed" : "");
}

INSTANTIATE_TEST_SUITE_P(
    Meshes, GPTEquivalence,
    ::testing::Values(
        Case{2, 1, 1, false}, Case{1, 2, 1, false}, Case{1, 1, 2, false}, Case{2, 2, 1, false},
        Case{2, 1, 2, false}, Case{1, 2, 2, false}, Case{2, 2, 2, false}, Case{3, 1, 1, false},
        // Every schedule with one stage per rank.
        Case{1, 2, 1, false, "gpipe", 4}, Case{2, 2, 1, false, "zbh1", 4},
        Case{2, 2, 2, false, "zbh1", 2},
        // Sequence parallelism: the same run as without it.
        Case{2, 1, 1, true}, Case{3, 1, 1, true}, Case{2, 2, 2, true},
        // Interleaved: v = 2 model chunks per PP rank (four
        // layers, one per chunk at pp 2), with TP, DP and SP
        // inside, and pp = 1 (both chunks on one rank).
        Case{1, 2, 1, false, "interleaved", 2, 2}, Case{1, 2, 1, false, "interleaved", 4, 2},
        Case{2, 2, 1, false, "interleaved", 2, 2}, Case{1, 2, 2, false, "interleaved", 2, 2},
        Case{2, 2, 2, true, "interleaved", 2, 2}, Case{1, 1, 1, false, "interleaved", 2, 2},
        Case{2, 1, 1, false, "interleaved", 4, 2},
        // Gradient accumulation: micro-batches under no_sync() with
        // finish_backward() after each, sequence parallelism inside.
        Case{2, 1, 1, true, "1f1b", 2, 1, 2}, Case{2, 1, 2, true, "1f1b", 2, 1, 2, true},
        Case{3, 1, 1, true, "1f1b", 2, 1, 4},
        // Untied embeddings (AdamW): nothing summed between the first and
        // the last stage, everything else as tied.
        untied_case(Case{1, 2, 1, false}), untied_case(Case{2, 2, 1, false}),
        untied_case(Case{2, 2, 2, true}), untied_case(Case{2, 2, 1, false, "zbh1", 4}),
        untied_case(Case{1, 2, 1, false, "interleaved", 2, 2}),
        // Context parallelism inside the pipeline stages, targets partly
        // ignored: every schedule at pp 2 x cp 2, with dp and with tp,
        // activations checkpointed under each; cp 2 alone as a control.
        context_case(Case{1, 2, 1, false}, 2), context_case(Case{1, 2, 1, false, "zbh1", 4}, 2),
        context_case(Case{1, 2, 1, false, "interleaved", 2, 2}, 2),
        context_case(Case{1, 2, 1, false, "1f1b", 4}, 2, true),
        context_case(Case{1, 2, 1, false, "zbh1", 2}, 2, true),
        context_case(Case{1, 2, 1, false, "interleaved", 4, 2}, 2, true),
        context_case(Case{1, 2, 2, false, "1f1b", 2}, 2),
        context_case(Case{2, 2, 1, false, "zbh1", 2}, 2, true),
        context_case(Case{1, 1, 1, false}, 2)),
    case_name);

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// Interleaved sizes that do not fit: an InvalidArgument on every rank naming
// the values, before any message is sent.
TEST(GPTInterleavedErrors, SizesThatDoNotFitAreNamed) {
  // Two layers cannot make pp 2 x v 2 chunks.
  auto errors = errors_on_every_rank(2, [](std::shared_ptr<Communicator> world) {
    auto mesh = init_device_mesh(world, {2, 1, 1}, {"pp", "dp", "tp"});
    GPTStage stage(mesh, config(false, 2, 2));
  });
  for (const auto& e : errors) {
    EXPECT_TRUE(has(e, "layers 2 do not divide into pp 2 x virtual_stages 2 = 4 model chunks"))
        << e;
  }
  // Only the interleaved schedule drives v > 1 chunks, with m a multiple of pp.
  const std::pair<const char*, int> bad[] = {{"1f1b", 2}, {"interleaved", 3}};
  for (const auto& [name, m] : bad) {
    errors = errors_on_every_rank(2, [&](std::shared_ptr<Communicator> world) {
      auto mesh = init_device_mesh(world, {2, 1, 1}, {"pp", "dp", "tp"});
      GPTStage stage(mesh, config(false, 2, 4));
      make_gpt_pipeline(mesh, stage, name, m);
    });
    for (const auto& e : errors) {
      EXPECT_TRUE(has(e, "virtual_stages 2")) << e;
      EXPECT_TRUE(m == 2 ? has(e, "not '1f1b'") : has(e, "multiple of pp 2; got 3")) << e;
    }
  }
}

}  // namespace
}  // namespace cohort::testing::gpt_equivalence_test
