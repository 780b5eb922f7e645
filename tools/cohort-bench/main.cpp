// cohort-bench collectives: an nccl-tests style table of one collective over
// a range of sizes, run on every rank of a job started by cohortrun:
//
//   cohortrun -n 2 -- cohort-bench collectives --op all_reduce --json
//
// Each size: warm-up, then `iters` timed operations back to back; a row's
// time is the slowest rank's mean (ranks agree through an all_reduce MAX).
#include <CLI/CLI.hpp>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "cohort/cohort.h"
#include "tools/cohort-bench/bus_bandwidth.h"

namespace {

struct Config {
  std::string op = "all_reduce";       // all_reduce | all_gather | reduce_scatter | broadcast
  std::string backend;                 // empty: COHORT_BACKEND or gloo
  std::string dtype = "float32";       // float32 | float16 | bfloat16 | float64
  int64_t min_bytes = 1 << 10;         // first row
  int64_t max_bytes = 64 << 20;        // last row (sizes double)
  int iters = 0;                       // 0: chosen per size (~ 64 MiB of traffic, 5..200)
  int warmup = 3;
  bool json = false;                   // one JSON object per row instead of the table
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

cohort::Work launch(cohort::Communicator& comm, const std::string& op, Buffers& buf) {
  if (op == "all_reduce") return comm.all_reduce(buf.a);
  if (op == "broadcast") return comm.broadcast(buf.a);
  if (op == "all_gather") return comm.all_gather_into_tensor(buf.b, buf.a);
  if (op == "reduce_scatter") return comm.reduce_scatter_tensor(buf.a, buf.b);
  throw cohort::InvalidArgument("cohort-bench: unknown --op " + op);
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

  if (leader && !cfg.json) {
    std::printf("# cohort-bench %s  backend %s  world %d  dtype %s\n", cfg.op.c_str(),
                comm->backend().c_str(), world, cfg.dtype.c_str());
    std::printf("%12s %8s %12s %12s %12s\n", "bytes", "iters", "time(us)", "algbw(GB/s)",
                "busbw(GB/s)");
  }
  for (int64_t bytes = cfg.min_bytes; bytes <= cfg.max_bytes; bytes *= 2) {
    const int64_t elements = std::max<int64_t>(bytes / esize, world);
    auto buf = make_buffers(cfg.op, elements, world, dt);
    const int iters =
        cfg.iters > 0 ? cfg.iters : static_cast<int>(std::clamp<int64_t>((64 << 20) / bytes, 5, 200));
    for (int i = 0; i < cfg.warmup; ++i) launch(*comm, cfg.op, buf).wait();
    comm->barrier().wait();
    const auto start = std::chrono::steady_clock::now();
    for (int i = 0; i < iters; ++i) launch(*comm, cfg.op, buf).wait();
    const double local_us =
        std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start).count() /
        iters;
    auto slowest = torch::tensor({local_us}, torch::kFloat64);
    comm->all_reduce(slowest, {cohort::ReduceOp::Max}).wait();
    const double us = slowest.item<double>();
    const double algbw = static_cast<double>(elements * esize) / us / 1e3;
    const double busbw = algbw * cohort::bench::bus_factor(cfg.op, world);
    if (!leader) continue;
    if (cfg.json) {
      nlohmann::json row = {{"op", cfg.op},         {"backend", comm->backend()},
                            {"algo", "engine"},     {"world", world},
                            {"bytes", elements * esize}, {"us", us},
                            {"algbw_gbs", algbw},   {"busbw_gbs", busbw}};
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
  coll->add_option("--backend", cfg.backend, "gloo | mpi (default: COHORT_BACKEND or gloo)");
  coll->add_option("--dtype", cfg.dtype, "float32 | float64 | float16 | bfloat16");
  coll->add_option("--min-bytes", cfg.min_bytes, "first size in bytes")->check(CLI::PositiveNumber);
  coll->add_option("--max-bytes", cfg.max_bytes, "last size in bytes")->check(CLI::PositiveNumber);
  coll->add_option("--iters", cfg.iters, "timed iterations per size (0: automatic)");
  coll->add_option("--warmup", cfg.warmup, "untimed iterations per size");
  coll->add_flag("--json", cfg.json, "one JSON object per row");
  CLI11_PARSE(app, argc, argv);
  try {
    return run(cfg);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort-bench: %s\n", e.what());
    return 1;
  }
}
