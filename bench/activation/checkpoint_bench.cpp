// Step time (forward + backward) and peak activation bytes of the GPT
// (examples/models/gpt_model.h, one rank, tp = 1) with and without
// GPTConfig::checkpoint_activations. Rounds alternate which side runs first;
// each round times `iters` steps per side. Prints each side's median step,
// the median of the per-round ratios, and the peaks (MemoryScope: the CPU
// tensor bytes a step allocates beyond the parameters and their gradients).
//
//   checkpoint_bench [--layers 12] [--hidden 128] [--seq 128] [--batch 8]
//                    [--iters 3] [--rounds 7]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "examples/models/gpt_model.h"

namespace {

using namespace cohort;
using namespace cohort::tensor_parallel;

struct Args {
  int64_t layers = 12, hidden = 128, seq = 128, batch = 8;
  int iters = 3, rounds = 7;
};

struct Side {
  GPTStage stage{nullptr};
  torch::Tensor ids, targets;
};

Side make_side(const DeviceMesh& mesh, const Args& a, bool checkpointed) {
  GPTConfig c;
  c.vocab_size = 64, c.seq_len = a.seq, c.hidden = a.hidden, c.heads = 4, c.layers = a.layers;
  c.dropout = 0.1;
  c.checkpoint_activations = checkpointed;
  Side s{GPTStage(mesh, c), {}, {}};
  s.ids = torch::randint(c.vocab_size, {a.batch, c.seq_len}, torch::kInt64);
  s.targets = (s.ids * 5 + 3) % c.vocab_size;
  for (auto p : s.stage->parameters()) p.mutable_grad() = torch::zeros_like(p);
  return s;
}

void step(Side& s) { s.stage->loss(s.stage(s.ids), s.targets).backward(); }

double seconds_per_step(Side& s, int iters) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) step(s);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}

int64_t peak_bytes(Side& s) {
  memory::MemoryScope scope;
  step(s);
  return scope.peak_bytes();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void add_flags(CLI::App& app, Args& a) {
  cohort::bench::show_defaults(app);
  app.add_option("--layers", a.layers, "transformer blocks")->check(cohort::bench::positive());
  app.add_option("--hidden", a.hidden, "model width")->check(cohort::bench::positive());
  app.add_option("--seq", a.seq, "sequence length")->check(cohort::bench::positive());
  app.add_option("--batch", a.batch, "sequences per step")->check(cohort::bench::positive());
  app.add_option("--iters", a.iters, "timed steps per side and round")
      ->check(cohort::bench::positive());
  app.add_option("--rounds", a.rounds, "rounds, alternating which side runs first")
      ->check(cohort::bench::positive());
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{
      "checkpoint_bench: a GPT's step time and activation peak with and without "
      "activation checkpointing"};
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    const ConnectOptions one_rank;  // named: GCC 12 warns falsely on a temporary's string
    auto comm = connect(std::make_shared<HashStore>(), 0, 1, one_rank);
    auto mesh = init_device_mesh(comm, {1, 1, 1}, {"pp", "dp", "tp"});
    Side plain = make_side(mesh, a, false), ckpt = make_side(mesh, a, true);
    step(plain), step(ckpt);  // warm-up
    std::vector<double> t_plain, t_ckpt, ratios;
    for (int r = 0; r < a.rounds; ++r) {
      double p, c;
      if (r % 2 == 0)
        p = seconds_per_step(plain, a.iters), c = seconds_per_step(ckpt, a.iters);
      else
        c = seconds_per_step(ckpt, a.iters), p = seconds_per_step(plain, a.iters);
      t_plain.push_back(p), t_ckpt.push_back(c), ratios.push_back(c / p);
    }
    const int64_t m_plain = peak_bytes(plain), m_ckpt = peak_bytes(ckpt);
    std::printf("layers %lld hidden %lld seq %lld batch %lld, %d rounds x %d steps\n",
                (long long)a.layers, (long long)a.hidden, (long long)a.seq, (long long)a.batch,
                a.rounds, a.iters);
    std::printf("| | step ms (median) | peak activation MiB |\n|---|---:|---:|\n");
    std::printf("| without | %.1f | %.2f |\n", 1e3 * median(t_plain), m_plain / 1048576.0);
    std::printf("| with | %.1f | %.2f |\n", 1e3 * median(t_ckpt), m_ckpt / 1048576.0);
    std::printf("| with / without | %.3f (median of per-round ratios) | %.3f |\n", median(ratios),
                double(m_ckpt) / double(m_plain));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "checkpoint_bench: %s\n", e.what());
    return 1;
  }
}
