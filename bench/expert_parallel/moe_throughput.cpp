// Tokens/s of one training step of the GPT (examples/models) with a MoE
// feed-forward every other block at ep 2, against the dense GPT at dp 2: the
// same world (2 ranks), the same tokens per rank and step, and the same
// active parameters per token. Each MoE block routes a token to one expert
// (top-1) whose FFN is H -> 4H -> H, as wide as the dense block's, so a
// token passes through the same FFN weights; the MoE block adds its router
// ([E, H], E H weights) and a dense block has none. A step is forward,
// backward, the GradientSynchronizer (dense gradients averaged over the
// world; at ep 2 the experts' are not reduced, each lives on one rank) and
// SGD. Ranks are threads of this process, one intra-op thread each. Rounds
// alternate which side runs first; medians and the median of the per-round
// ratios are printed, with the share of assignments the capacity dropped.
//
//   moe_throughput [--layers 4] [--hidden 256] [--heads 4] [--vocab 256]
//                  [--seq 128] [--batch 4] [--experts 8] [--capacity 1.25]
//                  [--iters 5] [--rounds 7] [--backend gloo]
#include <ATen/CPUGeneratorImpl.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "examples/models/gpt_model.h"

namespace {

using namespace cohort;
using namespace cohort::tensor_parallel;
using Clock = std::chrono::steady_clock;

struct Args {
  int64_t layers = 4, hidden = 256, heads = 4, vocab = 256, seq = 128, batch = 4, experts = 8;
  double capacity = 1.25;
  int iters = 5, rounds = 7;
  std::string backend = "gloo";
};

struct Timing {
  double seconds = 0;  // per step, the slowest rank's
  double dropped = 0;  // share of the MoE assignments dropped (rank 0, last step)
};

GPTConfig config_of(const Args& a, bool moe) {
  GPTConfig c;
  c.layers = a.layers;
  c.hidden = a.hidden;
  c.heads = a.heads;
  c.vocab_size = a.vocab;
  c.seq_len = a.seq;
  if (moe) {
    c.experts = a.experts;
    c.top_k = 1;
    c.capacity_factor = a.capacity;
  }
  return c;
}

int64_t moe_blocks(const Args& a) { return a.layers / 2; }

// One side on 2 rank threads: the MoE model over "ep" or the dense one over "dp".
Timing measure(const Args& a, bool moe) {
  auto store = std::make_shared<HashStore>();
  std::vector<double> seconds(2);
  double dropped = 0;
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      torch::set_num_threads(1);
      ConnectOptions co;
      co.backend = a.backend;
      auto world = connect(store, r, 2, co);
      auto mesh = init_device_mesh(world, {1, moe ? 1 : 2, moe ? 2 : 1, 1, 1},
                                   {"pp", "dp", "ep", "cp", "tp"});
      GPTStage stage(mesh, config_of(a, moe));
      GradientSynchronizerOptions options;
      options.expert_parameters = stage->expert_parameters();
      GradientSynchronizer sync(mesh, stage.ptr(), {}, stage->shared_embedding_weight(), options);
      torch::optim::SGD opt(stage->parameters(), torch::optim::SGDOptions(0.01));
      auto gen = at::detail::createCPUGenerator(100 + r);
      auto ids = torch::randint(a.vocab, {a.batch, a.seq}, gen);
      auto targets = torch::randint(a.vocab, {a.batch, a.seq}, gen);
      auto step = [&] {
        opt.zero_grad();
        sync.prepare_forward();
        auto loss = stage->loss(stage(ids), targets);
        sync.after_forward({loss});
        loss.backward();
        sync.finish_backward();
        opt.step();
      };
      step();  // warm-up: allocations, connections
      world->barrier().wait();
      const auto t0 = Clock::now();
      for (int i = 0; i < a.iters; ++i) step();
      world->barrier().wait();
      seconds[static_cast<size_t>(r)] =
          std::chrono::duration<double>(Clock::now() - t0).count() / a.iters;
      if (moe && r == 0) {
        int64_t drops = 0;
        for (const auto& m : stage->modules()) {
          if (auto p = std::dynamic_pointer_cast<expert_parallel::MoEImpl>(m))
            drops += p->dropped();
        }
        dropped = static_cast<double>(drops) / static_cast<double>(moe_blocks(a) * a.batch * a.seq);
      }
    });
  }
  for (auto& t : threads) t.join();
  return {*std::max_element(seconds.begin(), seconds.end()), dropped};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"moe_throughput: tokens/s of the GPT with MoE at ep 2 against dense at dp 2"};
  cohort::bench::show_defaults(app);
  app.add_option("--layers", a.layers, "blocks (the odd ones MoE)")
      ->check(cohort::bench::at_least(2, "AT_LEAST_2"));
  app.add_option("--hidden", a.hidden, "model width H (FFN H -> 4H -> H)")
      ->check(cohort::bench::positive());
  app.add_option("--heads", a.heads, "attention heads")->check(cohort::bench::positive());
  app.add_option("--vocab", a.vocab, "vocabulary")->check(cohort::bench::positive());
  app.add_option("--seq", a.seq, "sequence length")->check(cohort::bench::positive());
  app.add_option("--batch", a.batch, "sequences per rank and step")
      ->check(cohort::bench::positive());
  app.add_option("--experts", a.experts, "experts per MoE block (even: split over ep 2)")
      ->check(cohort::bench::at_least(2, "AT_LEAST_2"));
  app.add_option("--capacity", a.capacity, "capacity factor")->check(CLI::PositiveNumber);
  app.add_option("--iters", a.iters, "timed steps per side and round")
      ->check(cohort::bench::positive());
  app.add_option("--rounds", a.rounds, "rounds, alternating which side runs first")
      ->check(cohort::bench::positive());
  app.add_option("--backend", a.backend, "engine: gloo or ucx");
  CLI11_PARSE(app, argc, argv);
  const auto H = a.hidden;
  std::printf(
      "GPT %lld layers (%lld MoE), H %lld, seq %lld, batch %lld per rank, world 2; MoE: %lld "
      "experts top-1 of H->4H->H at ep 2; dense: dp 2; %s\n",
      static_cast<long long>(a.layers), static_cast<long long>(moe_blocks(a)),
      static_cast<long long>(H), static_cast<long long>(a.seq), static_cast<long long>(a.batch),
      static_cast<long long>(a.experts), a.backend.c_str());
  std::printf("active FFN weights per token and block: %lld both (+ router %lld in a MoE block)\n",
              static_cast<long long>(8 * H * H + 5 * H), static_cast<long long>(a.experts * H));
  const double tokens = 2.0 * static_cast<double>(a.batch * a.seq);  // per step, both ranks
  std::vector<double> dense_tps, moe_tps, ratios, drops;
  for (int round = 0; round < a.rounds; ++round) {
    Timing d, m;
    if (round % 2 == 0) {
      d = measure(a, false);
      m = measure(a, true);
    } else {
      m = measure(a, true);
      d = measure(a, false);
    }
    dense_tps.push_back(tokens / d.seconds);
    moe_tps.push_back(tokens / m.seconds);
    ratios.push_back(d.seconds / m.seconds);
    drops.push_back(m.dropped);
    std::printf("round %d: dense %.0f tok/s  moe %.0f tok/s  moe/dense %.3f  dropped %.3f\n", round,
                dense_tps.back(), moe_tps.back(), ratios.back(), drops.back());
  }
  std::printf(
      "median: dense %.0f tok/s  moe %.0f tok/s  moe/dense %.3f (median of ratios, %.3f-%.3f)  "
      "dropped %.3f\n",
      median(dense_tps), median(moe_tps), median(ratios),
      *std::min_element(ratios.begin(), ratios.end()),
      *std::max_element(ratios.begin(), ratios.end()), median(drops));
  return 0;
}
