// Tokens/s of a transformer MLP block (ColumnParallelLinear H -> 4H, GELU,
// RowParallelLinear 4H -> H; forward and backward) at TP = 1 and TP = 2, one
// thread per rank with one intra-op thread each, so TP = 2 uses two cores.
// Rounds alternate which side runs first; the medians and the median of the
// per-round ratios are printed.
//
//   tp_scaling [--hidden 1024] [--tokens 256] [--iters 5] [--rounds 5]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "cohort/tensor_parallel/layers.h"

namespace {

using namespace cohort;
using namespace cohort::tensor_parallel;

struct Args {
  int64_t hidden = 1024, tokens = 256;
  int iters = 5, rounds = 5;
};

// Seconds per forward+backward iteration (the slowest rank's), at `tp`.
double measure(const Args& a, int tp) {
  auto store = std::make_shared<HashStore>();
  std::vector<double> seconds(static_cast<size_t>(tp));
  std::vector<std::thread> threads;
  for (int r = 0; r < tp; ++r) {
    threads.emplace_back([&, r] {
      ConnectOptions co;
      co.backend = "gloo";
      auto comm = connect(std::make_shared<PrefixStore>("tp", store), r, tp, co);
      ColumnParallelLinearOptions col;
      col.seed = 1;
      RowParallelLinearOptions row;
      row.seed = 2;
      ColumnParallelLinear fc1(cohort::DeviceMesh::from_group(comm, "tp"), a.hidden, 4 * a.hidden,
                               col);
      RowParallelLinear fc2(cohort::DeviceMesh::from_group(comm, "tp"), 4 * a.hidden, a.hidden,
                            row);
      auto x = torch::randn({a.tokens, a.hidden}).requires_grad_();
      auto iterate = [&] {
        auto y = fc2(torch::gelu(fc1(x)));
        y.sum().backward();
      };
      iterate();  // warm-up: allocations, connections
      comm->barrier().wait();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < a.iters; ++i) iterate();
      comm->barrier().wait();
      seconds[static_cast<size_t>(r)] =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / a.iters;
    });
  }
  for (auto& t : threads) t.join();
  return *std::max_element(seconds.begin(), seconds.end());
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const auto n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"tp_scaling: tokens/s of a transformer MLP block at TP = 1 and TP = 2"};
  cohort::bench::show_defaults(app);
  app.add_option("--hidden", a.hidden, "model width H (the block is H -> 4H -> H)")
      ->check(cohort::bench::positive());
  app.add_option("--tokens", a.tokens, "tokens per iteration")->check(cohort::bench::positive());
  app.add_option("--iters", a.iters, "timed iterations per side and round")
      ->check(cohort::bench::positive());
  app.add_option("--rounds", a.rounds, "rounds, alternating which side runs first")
      ->check(cohort::bench::positive());
  CLI11_PARSE(app, argc, argv);
  torch::set_num_threads(1);
  std::printf("MLP block H=%lld -> %lld -> H, %lld tokens, fwd+bwd, %d iters x %d rounds\n",
              static_cast<long long>(a.hidden), static_cast<long long>(4 * a.hidden),
              static_cast<long long>(a.tokens), a.iters, a.rounds);
  std::vector<double> tps1, tps2, ratios;
  for (int round = 0; round < a.rounds; ++round) {
    double s1, s2;
    if (round % 2 == 0) {
      s1 = measure(a, 1);
      s2 = measure(a, 2);
    } else {
      s2 = measure(a, 2);
      s1 = measure(a, 1);
    }
    tps1.push_back(a.tokens / s1);
    tps2.push_back(a.tokens / s2);
    ratios.push_back(s1 / s2);
    std::printf("round %d: tp1 %.0f tok/s  tp2 %.0f tok/s  speedup %.2fx\n", round, tps1.back(),
                tps2.back(), ratios.back());
  }
  std::printf("median: tp1 %.0f tok/s  tp2 %.0f tok/s  speedup %.2fx (median of ratios)\n",
              median(tps1), median(tps2), median(ratios));
  return 0;
}
