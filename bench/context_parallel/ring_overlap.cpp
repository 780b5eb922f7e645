// How much of ring attention's point-to-point time its overlap hides: one
// forward and backward (the slowest rank's time) with each step's transfer
// posted before the block's attention (overlap) and finished before it
// (serial), and the same transfers alone (comm: the ring's hops of the same
// blocks, no attention). hidden = (serial - overlap) / comm. Ranks are
// threads of this process, one intra-op thread each. Rounds alternate which
// side runs first; medians are printed. Of the 3cp-2 hops of a step, the
// last dK/dV hop has no attention left to hide behind: at most
// (3cp-3)/(3cp-2) can be hidden.
//
//   ring_overlap [--cp 2] [--seq 1024] [--batch 1] [--heads 8] [--dim 64]
//                [--iters 5] [--rounds 9] [--backend ucx]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <thread>
#include <vector>

#include "bench/cli.h"
#include "cohort/cohort.h"

namespace {

using namespace cohort;
using namespace cohort::context_parallel;
using Clock = std::chrono::steady_clock;

struct Args {
  int cp = 2, iters = 5, rounds = 9;
  int64_t seq = 1024, batch = 1, heads = 8, dim = 64;
  std::string backend = "ucx";
};

enum class Side { Overlap, Serial, Comm };

// The hops of one forward and backward, without the attention.
void hops_alone(Communicator& g, const torch::Tensor& block) {
  const int cp = g.size(), next = (g.rank() + 1) % cp, prev = (g.rank() + cp - 1) % cp;
  auto incoming = torch::empty_like(block);
  for (int h = 0; h < 3 * cp - 2; ++h) {
    std::vector<Work> works{g.recv(incoming, prev, {h}), g.send(block, next, {h})};
    wait_all(works);
  }
}

double seconds(Communicator& g, const std::shared_ptr<Communicator>& shared, const Args& a,
               Side side) {
  const ZigZagLayout layout(a.seq, a.cp);
  const int64_t rows = layout.local_length(g.rank());
  auto q = torch::randn({a.batch, a.heads, rows, a.dim}).requires_grad_();
  auto k = torch::randn_like(q).requires_grad_(), v = torch::randn_like(q).requires_grad_();
  auto block = torch::randn({2, a.batch, a.heads, rows, a.dim});
  RingAttentionOptions o;
  o.overlap = side == Side::Overlap;
  g.barrier().wait();
  const auto t0 = Clock::now();
  for (int i = 0; i < a.iters; ++i) {
    if (side == Side::Comm) {
      hops_alone(g, block);
    } else {
      ring_attention(q, k, v, shared, o).sum().backward();
    }
  }
  g.barrier().wait();  // the slowest rank's time
  return std::chrono::duration<double>(Clock::now() - t0).count() / a.iters;
}

// Seconds per step of each side, in `order`, on cp rank threads.
std::vector<double> round_of(const Args& a, const std::vector<Side>& order) {
  auto store = std::make_shared<HashStore>();
  std::vector<double> out(order.size());
  std::vector<std::thread> threads;
  for (int r = 0; r < a.cp; ++r) {
    threads.emplace_back([&, r] {
      torch::set_num_threads(1);
      ConnectOptions co;
      co.backend = a.backend;
      auto comm = connect(store, r, a.cp, co);
      for (size_t s = 0; s < order.size(); ++s) {
        const double t = seconds(*comm, comm, a, order[s]);
        if (r == 0) out[s] = t;
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app("ring attention: the share of the point-to-point time overlap hides");
  cohort::bench::show_defaults(app);
  app.add_option("--cp", a.cp, "context-parallel ranks (threads)")
      ->check(cohort::bench::at_least(2, "CP"));
  app.add_option("--seq", a.seq, "total sequence length")->check(cohort::bench::positive());
  app.add_option("--batch", a.batch, "batch")->check(cohort::bench::positive());
  app.add_option("--heads", a.heads, "heads")->check(cohort::bench::positive());
  app.add_option("--dim", a.dim, "head_dim")->check(cohort::bench::positive());
  app.add_option("--iters", a.iters, "steps timed per side and round")
      ->check(cohort::bench::positive());
  app.add_option("--rounds", a.rounds, "rounds (alternating order)")
      ->check(cohort::bench::positive());
  app.add_option("--backend", a.backend, "engine: ucx or gloo");
  CLI11_PARSE(app, argc, argv);
  std::vector<double> overlap, serial, comm, hidden;
  for (int round = 0; round < a.rounds; ++round) {
    std::vector<Side> order{Side::Overlap, Side::Serial, Side::Comm};
    if (round % 2) std::swap(order[0], order[1]);
    const auto t = round_of(a, order);
    const double o = t[round % 2 ? 1 : 0], s = t[round % 2 ? 0 : 1];
    overlap.push_back(o), serial.push_back(s), comm.push_back(t[2]);
    hidden.push_back((s - o) / t[2]);
  }
  std::printf("cp %d, seq %lld, batch %lld, heads %lld, dim %lld, %s: forward+backward per step\n",
              a.cp, static_cast<long long>(a.seq), static_cast<long long>(a.batch),
              static_cast<long long>(a.heads), static_cast<long long>(a.dim), a.backend.c_str());
  std::printf("  overlap %.3f ms, serial %.3f ms, hops alone %.3f ms (medians of %d rounds)\n",
              median(overlap) * 1e3, median(serial) * 1e3, median(comm) * 1e3, a.rounds);
  std::printf("  hidden share of the hops: median %.2f (at most %.2f)\n", median(hidden),
              (3.0 * a.cp - 3) / (3.0 * a.cp - 2));
  return 0;
}
