#include "tools/cohort-bench/p2p.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "cohort/cohort.h"

namespace cohort::bench {
namespace {

using Clock = std::chrono::steady_clock;

double percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * static_cast<double>(v.size() - 1))];
}

// One round trip seen from rank 0 (rank 1 mirrors it); its time in us.
double round_trip(Communicator& comm, torch::Tensor& out, torch::Tensor& in) {
  const auto t0 = Clock::now();
  const int peer = 1 - comm.rank();
  if (comm.rank() == 0) {
    comm.send(out, peer).wait();
    comm.recv(in, peer).wait();
  } else {
    comm.recv(in, peer).wait();
    comm.send(out, peer).wait();
  }
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

// With --early-recv-ms: rank 0 posts its receive, "computes" (sleeps) that
// long while rank 1 sends, then waits: what wait() still has to do once
// the computation ended (a pipeline stage's receive, posted before its
// forward). Its time in us.
double early_receive(Communicator& comm, torch::Tensor& out, torch::Tensor& in, int ms) {
  if (comm.rank() == 1) {
    comm.send(out, 0).wait();
    return 0;
  }
  auto r = comm.recv(in, 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(ms));
  const auto t0 = Clock::now();
  r.wait();
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}

}  // namespace

int run_ping_pong(const PingPongConfig& cfg) {
  torch::set_num_threads(1);
  InitOptions io;
  io.backend = cfg.backend;
  auto comm = init(io);
  if (comm->size() < 2) throw InvalidArgument("cohort-bench p2p: needs 2 ranks or more");
  const bool active = comm->rank() < 2, leader = comm->rank() == 0;
  if (leader && !cfg.json) {
    std::printf("# cohort-bench p2p  backend %s  %s\n", comm->backend().c_str(),
                cfg.early_recv_ms > 0 ? "us in the early receive's wait()"
                                      : "one-way us (half a round trip)");
    std::printf("%12s %8s %10s %10s %10s\n", "bytes", "iters", "p10", "p50", "p90");
  }
  for (const int64_t bytes : cfg.bytes) {
    const int64_t n = std::max<int64_t>(bytes / 4, 1);
    const int iters =
        cfg.iters > 0
            ? cfg.iters
            : static_cast<int>(std::clamp<int64_t>((int64_t{256} << 20) / (n * 4), 20, 2000));
    auto out = torch::ones({n}), in = torch::empty({n});
    std::vector<double> us;
    comm->barrier().wait();
    if (active) {
      const int ms = cfg.early_recv_ms;
      for (int i = 0; i < cfg.warmup; ++i) {
        ms > 0 ? early_receive(*comm, out, in, ms) : round_trip(*comm, out, in);
      }
      for (int i = 0; i < iters; ++i) {
        us.push_back(ms > 0 ? early_receive(*comm, out, in, ms) : round_trip(*comm, out, in) / 2);
      }
    }
    comm->barrier().wait();
    if (!leader) continue;
    const double p10 = percentile(us, 0.1), p50 = percentile(us, 0.5), p90 = percentile(us, 0.9);
    if (cfg.json) {
      nlohmann::json row = {{"op", "p2p"},
                            {"backend", comm->backend()},
                            {"bytes", n * 4},
                            {"iters", iters},
                            {"early_recv_ms", cfg.early_recv_ms},
                            {"p10_us", p10},
                            {"p50_us", p50},
                            {"p90_us", p90}};
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::printf("%12lld %8d %10.1f %10.1f %10.1f\n", static_cast<long long>(n * 4), iters, p10,
                  p50, p90);
    }
    std::fflush(stdout);
  }
  finalize();
  return 0;
}

}  // namespace cohort::bench
