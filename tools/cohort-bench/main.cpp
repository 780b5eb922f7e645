// cohort-bench collectives: an nccl-tests style table of one collective over
// a range of sizes, run on every rank of a job started by cohortrun:
//
//   cohortrun -n 2 -- cohort-bench collectives --op all_reduce --json
//
// (cohort-bench p2p: point-to-point latency, tools/cohort-bench/p2p.h.)
//
// Each size: warm-up, then `iters` timed operations back to back; a row's
// time is the slowest rank's mean (ranks agree through an all_reduce MAX).
//
// --algo picks the collective algorithm (engine, ring, tree, hd,
// hierarchical, adaptive); --algo all runs every one side by side at each
// size, --rounds times in rotating order, and prints the busbw of each (by default from the mean
// time of all its operations), the best fixed algorithm, adaptive's pick, adaptive / best (the
// adaptive column against the best) and pick / best (the picked algorithm's own column against the
// best: the choice without the adaptive column's noise).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cohort/algorithms/calibration.h"
#include "cohort/cohort.h"
#include "tools/cohort-bench/bus_bandwidth.h"
#include "tools/cohort-bench/p2p.h"

namespace {

struct Config {
  std::string op = "all_reduce";       // all_reduce | all_gather | reduce_scatter | broadcast
  std::string reduce_op = "sum";       // sum | min | max (all_reduce, reduce_scatter)
  std::string backend;                 // empty: COHORT_BACKEND or gloo
  std::string dtype = "float32";       // float32 | float16 | bfloat16 | float64
  int64_t min_bytes = 1 << 10;         // first row
  int64_t max_bytes = 64 << 20;        // last row (sizes double)
  int iters = 0;                       // 0: chosen per size (~ 64 MiB of traffic, 5..200)
  int warmup = 3;
  bool json = false;                   // one JSON object per row instead of the table
  std::string algo = "engine";         // an algorithm name, or "all"
  int rounds = 3;                      // --algo all: alternating rounds per size
  std::string stat = "mean";           // --algo all: each algorithm's figure over its rounds
  bool per_op_median = false;          // a run's figure: the median operation, not the mean
};

torch::Dtype parse_dtype(const std::string& s) {
  if (s == "float32") return torch::kFloat32;
  if (s == "float64") return torch::kFloat64;
  if (s == "float16") return torch::kFloat16;
  if (s == "bfloat16") return torch::kBFloat16;
  throw cohort::InvalidArgument("cohort-bench: unknown --dtype " + s);
}

// One operation on buffers sized for `bytes` (nccl-tests: the full size).
struct Buffers {
  torch::Tensor a, b;
};

Buffers make_buffers(const std::string& op, int64_t elements, int world, torch::Dtype dt) {
  if (op == "all_gather") {
    return {torch::ones({elements / world}, dt), torch::empty({elements / world * world}, dt)};
  }
  if (op == "reduce_scatter") {
    return {torch::empty({elements / world}, dt), torch::ones({elements / world * world}, dt)};
  }
  return {torch::ones({elements}, dt), {}};
}

cohort::ReduceOp parse_reduce_op(const std::string& s) {
  if (s == "min") return cohort::ReduceOp::Min;
  if (s == "max") return cohort::ReduceOp::Max;
  return cohort::ReduceOp::Sum;
}

cohort::Work launch(cohort::Communicator& comm, const std::string& op, Buffers& buf,
                    cohort::Algorithm algo, cohort::ReduceOp reduce_op) {
  if (op == "all_reduce") {
    cohort::AllReduceOptions o;
    o.algo = algo;
    o.op = reduce_op;
    return comm.all_reduce(buf.a, o);
  }
  if (op == "broadcast") return comm.broadcast(buf.a);
  if (op == "all_gather") {
    cohort::AllGatherOptions o;
    o.algo = algo;
    return comm.all_gather_into_tensor(buf.b, buf.a, o);
  }
  if (op == "reduce_scatter") {
    cohort::ReduceScatterOptions o;
    o.algo = algo;
    o.op = reduce_op;
    return comm.reduce_scatter_tensor(buf.a, buf.b, o);
  }
  throw cohort::InvalidArgument("cohort-bench: unknown --op " + op);
}

cohort::Collective collective_of(const std::string& op) {
  if (op == "all_gather") return cohort::Collective::AllGather;
  if (op == "reduce_scatter") return cohort::Collective::ReduceScatter;
  return cohort::Collective::AllReduce;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Slowest rank's time (us) of one of `iters` operations after `warmup`:
// their mean, or with --per-op-median the median operation (each timed
// alone: on a shared host a few percent of operations stall for
// milliseconds, which moves a mean of small ones far more than the median).
double time_op(cohort::Communicator& comm, const Config& cfg, Buffers& buf,
               cohort::Algorithm algo, int iters) {
  using Clock = std::chrono::steady_clock;
  const auto rop = parse_reduce_op(cfg.reduce_op);
  for (int i = 0; i < cfg.warmup; ++i) launch(comm, cfg.op, buf, algo, rop).wait();
  comm.barrier().wait();
  std::vector<double> each;
  const auto start = Clock::now();
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    launch(comm, cfg.op, buf, algo, rop).wait();
    if (cfg.per_op_median) {
      each.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
    }
  }
  const double local_us =
      cfg.per_op_median
          ? median(each)
          : std::chrono::duration<double, std::micro>(Clock::now() - start).count() / iters;
  auto slowest = torch::tensor({local_us}, torch::kFloat64);
  comm.all_reduce(slowest, {cohort::ReduceOp::Max}).wait();
  return slowest.item<double>();
}

// An algorithm's time over its rounds (each a mean over the same number of
// operations): the mean of all its operations (nccl-tests' figure: every
// round counts, so a few rounds that hit more of the host's scheduling
// stalls move it less than they move a median of few rounds), the median
// round, or the fastest round (the least disturbed: noise on a shared
// machine only ever adds time).
double summarize(const std::vector<double>& v, const std::string& stat) {
  if (stat == "min") return *std::min_element(v.begin(), v.end());
  if (stat == "mean") {
    double sum = 0;
    for (double x : v) sum += x;
    return sum / static_cast<double>(v.size());
  }
  return median(v);
}

// --algo all: every algorithm at every size, in alternating rounds.
int run_all(cohort::Communicator& comm, const Config& cfg, torch::Dtype dt) {
  using cohort::Algorithm;
  const int world = comm.size();
  const int64_t esize = torch::elementSize(dt);
  const bool leader = comm.rank() == 0;
  std::vector<Algorithm> algos{Algorithm::Engine, Algorithm::Ring, Algorithm::HalvingDoubling};
  if (cfg.op == "all_reduce") {
    algos.push_back(Algorithm::Tree);
    algos.push_back(Algorithm::Hierarchical);
  }
  algos.push_back(Algorithm::Adaptive);
  // Calibrate before anything is timed, and show what adaptive will use.
  const auto model = comm.describe_cost_model(collective_of(cfg.op));
  if (leader && !cfg.json) {
    std::printf("# cohort-bench %s  backend %s  world %d  dtype %s  --algo all  rounds %d "
                "(%s busbw GB/s)\n# %s\n",
                cfg.op.c_str(), comm.backend().c_str(), world, cfg.dtype.c_str(), cfg.rounds,
                cfg.stat == "min" ? "best-round" : cfg.stat.c_str(), model.c_str());
    std::printf("%10s", "bytes");
    for (auto a : algos) std::printf(" %12s", cohort::to_string(a).c_str());
    std::printf(" %12s %12s %9s %9s\n", "best fixed", "adaptive→", "adapt/best", "pick/best");
  }
  for (int64_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= 2) {
    const int64_t elements = std::max<int64_t>(bytes / esize, world);
    auto buf = make_buffers(cfg.op, elements, world, dt);
    const int iters = cfg.iters > 0 ? cfg.iters
                                    : static_cast<int>(std::clamp<int64_t>((64 << 20) / bytes, 5, 200));
    std::vector<std::vector<double>> us(algos.size());
    // The algorithms take turns in a balanced order (each follows each
    // other equally often), since what ran just before shifts a run's time
    // here (measured: always following hierarchical, the engine's own
    // collective read 25% slower than the same collective following
    // adaptive).
    for (int round = 0; round < cfg.rounds; ++round) {
      for (size_t j = 0; j < algos.size(); ++j) {
        const size_t i = cohort::algorithms::balanced_order(algos.size(), round, j);
        us[i].push_back(time_op(comm, cfg, buf, algos[i], iters));
      }
    }
    const int64_t nbytes = (cfg.op == "all_reduce" ? elements : elements / world * world) * esize;
    auto busbw = [&](double t) {
      return static_cast<double>(nbytes) / t / 1e3 * cohort::bench::bus_factor(cfg.op, world);
    };
    const auto picked = comm.resolve_algorithm(collective_of(cfg.op), nbytes, Algorithm::Adaptive);
    if (!leader) continue;
    size_t best = 0;
    for (size_t i = 0; i + 1 < algos.size(); ++i) {
      if (summarize(us[i], cfg.stat) < summarize(us[best], cfg.stat)) best = i;
    }
    const double ratio = summarize(us[best], cfg.stat) / summarize(us.back(), cfg.stat);
    // The choice alone, without the adaptive column's own noise: best fixed
    // over the fixed column of the algorithm adaptive picked.
    const size_t picked_column = static_cast<size_t>(
        std::find(algos.begin(), algos.end(), picked) - algos.begin());
    const double pick_ratio =
        summarize(us[best], cfg.stat) / summarize(us[picked_column], cfg.stat);
    if (cfg.json) {
      nlohmann::json row = {{"op", cfg.op}, {"backend", comm.backend()}, {"world", world},
                            {"bytes", nbytes}, {"best", cohort::to_string(algos[best])},
                            {"adaptive_picked", cohort::to_string(picked)},
                            {"adaptive_over_best", ratio}, {"pick_over_best", pick_ratio}};
      for (size_t i = 0; i < algos.size(); ++i) {
        row["busbw_gbs"][cohort::to_string(algos[i])] = busbw(summarize(us[i], cfg.stat));
        row["us"][cohort::to_string(algos[i])] = summarize(us[i], cfg.stat);
      }
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::printf("%10lld", static_cast<long long>(nbytes));
      for (auto& u : us) std::printf(" %12.3f", busbw(summarize(u, cfg.stat)));
      std::printf(" %12s %12s %9.2f %9.2f\n", cohort::to_string(algos[best]).c_str(),
                  cohort::to_string(picked).c_str(), ratio, pick_ratio);
    }
    std::fflush(stdout);
  }
  return 0;
}

int run(const Config& cfg) {
  torch::set_num_threads(1);
  cohort::InitOptions io;
  io.backend = cfg.backend;
  auto comm = cohort::init(io);
  const int world = comm->size();
  const auto dt = parse_dtype(cfg.dtype);
  const int64_t esize = torch::elementSize(dt);
  const bool leader = comm->rank() == 0;
  if (cfg.algo == "all") {
    const int rc = run_all(*comm, cfg, dt);
    cohort::finalize();
    return rc;
  }
  const auto algo = *cohort::parse_algorithm(cfg.algo);

  if (leader && !cfg.json) {
    std::printf("# cohort-bench %s  backend %s  world %d  dtype %s  algo %s\n", cfg.op.c_str(),
                comm->backend().c_str(), world, cfg.dtype.c_str(), cfg.algo.c_str());
    std::printf("%12s %8s %12s %12s %12s\n", "bytes", "iters", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)");
  }
  for (int64_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= 2) {
    const int64_t elements = std::max<int64_t>(bytes / esize, world);
    auto buf = make_buffers(cfg.op, elements, world, dt);
    const int iters =
        cfg.iters > 0 ? cfg.iters : static_cast<int>(std::clamp<int64_t>((64 << 20) / bytes, 5, 200));
    const double us = time_op(*comm, cfg, buf, algo, iters);
    const double algbw = static_cast<double>(elements * esize) / us / 1e3;
    const double busbw = algbw * cohort::bench::bus_factor(cfg.op, world);
    if (!leader) continue;
    if (cfg.json) {
      nlohmann::json row = {{"op", cfg.op},
                            {"reduce_op", cfg.reduce_op},
                            {"backend", comm->backend()},
                            {"algo", cfg.algo},
                            {"world", world},
                            {"bytes", elements * esize},
                            {"us", us},
                            {"algbw_gbs", algbw},
                            {"busbw_gbs", busbw}};
      std::printf("%s\n", row.dump().c_str());
    } else {
      std::printf("%12lld %8d %12.1f %12.3f %12.3f\n", static_cast<long long>(elements * esize),
                  iters, us, algbw, busbw);
    }
    std::fflush(stdout);
  }
  cohort::finalize();
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"cohort-bench: cohort's benchmarks"};
  app.require_subcommand(1);
  Config cfg;
  auto* coll = app.add_subcommand("collectives", "nccl-tests style table of one collective");
  coll->add_option("--op", cfg.op, "all_reduce | all_gather | reduce_scatter | broadcast")
      ->check(CLI::IsMember({"all_reduce", "all_gather", "reduce_scatter", "broadcast"}));
  coll->add_option("--reduce-op", cfg.reduce_op, "sum | min | max (all_reduce, reduce_scatter)")
      ->check(CLI::IsMember({"sum", "min", "max"}));
  coll->add_option("--backend", cfg.backend,
                   "gloo | mpi | ucx | auto (default: COHORT_BACKEND or gloo)");
  coll->add_option("--dtype", cfg.dtype, "float32 | float64 | float16 | bfloat16");
  coll->add_option("--min-bytes", cfg.min_bytes, "first size in bytes")->check(CLI::PositiveNumber);
  coll->add_option("--max-bytes", cfg.max_bytes, "last size in bytes")->check(CLI::PositiveNumber);
  coll->add_option("--iters", cfg.iters, "timed iterations per size (0: automatic)");
  coll->add_option("--warmup", cfg.warmup, "untimed iterations per size");
  coll->add_flag("--json", cfg.json, "one JSON object per row");
  coll->add_flag("--per-op-median", cfg.per_op_median,
                 "time each operation; a run's figure is the median one, not the mean");
  coll->add_option("--algo", cfg.algo,
                   "engine | ring | tree | hd | hierarchical | adaptive | all (side by side)")
      ->check(CLI::IsMember({"engine", "ring", "tree", "hd", "hierarchical", "adaptive", "all"}));
  coll->add_option("--rounds", cfg.rounds, "--algo all: rounds per size, in rotating order")
      ->check(CLI::PositiveNumber);
  coll->add_option("--stat", cfg.stat,
                   "--algo all: mean (of all operations) | median (round) | min (fastest round)")
      ->check(CLI::IsMember({"mean", "median", "min"}));
  cohort::bench::PingPongConfig pp;
  auto* p2p = app.add_subcommand("p2p", "point-to-point latency: a ping-pong of ranks 0 and 1");
  p2p->add_option("--backend", pp.backend, "gloo | mpi | ucx (default: COHORT_BACKEND or gloo)");
  pp.bytes = {1024, 65536, 16777216};
  p2p->add_option("--bytes", pp.bytes, "message sizes, one row each (1024,65536,16777216)")
      ->delimiter(',');
  p2p->add_option("--iters", pp.iters, "round trips per size (0: automatic)");
  p2p->add_option("--warmup", pp.warmup, "untimed round trips per size");
  p2p->add_option("--early-recv-ms", pp.early_recv_ms,
                  "time the wait() of a receive posted this long before (0: ping-pong)");
  p2p->add_flag("--json", pp.json, "one JSON object per row");
  CLI11_PARSE(app, argc, argv);
  try {
    if (p2p->parsed()) return cohort::bench::run_ping_pong(pp);
    return run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort-bench: %s\n", e.what());
    return 1;
  }
}
