// The cohort half of the compression benchmark: one rank of a DDP training
// loop with a compressor (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the
// environment, as cohortrun sets them). Rank 0 prints one JSON line:
//   {"engine": "cohort", "compressor", "model", "world", "bytes_per_step",
//    "step_ms"}
// bytes_per_step: bytes that left this host per timed step and rank,
// read from the link's own counter (/sys/class/net/$COMPRESSION_BENCH_DEV/
// statistics/tx_bytes in the host's namespace; TCP/IP headers included,
// ~4%), divided by the ranks on the host; step_ms: median over timed steps
// of the slowest rank's step; engine_bytes_per_step: DDPStats::bytes_sent,
// the communicator's count at the engine boundary (largest over ranks).
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "bench/cli.h"
#include "bench/ddp_vs_torch/bench_models.h"
#include "cohort/cohort.h"
#include "cohort/ddp/distributed_data_parallel.h"

namespace {

struct Args {
  std::string model = "cnn";  // cnn | transformer | mlp
  std::string compressor = "none";
  int64_t batch = 32;         // per rank
  int steps = 10;             // timed
  int warmup = 3;             // untimed (bucket rebuild; PowerSGD's first Q)
  std::string only = "step";  // compressor: time the compressor's arithmetic alone
  cohort::DDPOptions ddp;
};

// A compressor name as parse_compression_kind takes it; its message otherwise.
const CLI::Validator kCompressionName(
    [](std::string& name) {
      try {
        cohort::compression::parse_compression_kind(name);
        return std::string();
      } catch (const std::exception& e) {
        return std::string(e.what());
      }
    },
    "none|fp16|bf16|int8|topk|powersgd");

// Flags as run_compression_bench.sh and docs/benchmarks.md pass them;
// --help lists them with their defaults.
void add_flags(CLI::App& app, Args& a) {
  cohort::bench::show_defaults(app);
  app.add_option("--model", a.model, "cnn | transformer | mlp")
      ->check(CLI::IsMember({"cnn", "transformer", "mlp"}));
  app.add_option("--compression", a.compressor, "the DDP compressor")->check(kCompressionName);
  cohort::bench::add_loop_flags(app, a.batch, a.steps, a.warmup);
  app.add_option("--powersgd-rank", a.ddp.compression.powersgd_rank,
                 "CompressionOptions::powersgd_rank");
  app.add_option("--topk-ratio", a.ddp.compression.topk_ratio, "CompressionOptions::topk_ratio");
  app.add_option("--only", a.only,
                 "step: whole training steps; compressor: the compressor's all-reduce alone")
      ->check(CLI::IsMember({"step", "compressor"}));
}

// Bytes sent so far by the link named in COMPRESSION_BENCH_DEV (-1 without).
int64_t link_tx_bytes() {
  const char* dev = std::getenv("COMPRESSION_BENCH_DEV");
  if (dev == nullptr) return -1;
  std::ifstream in(std::string("/sys/class/net/") + dev + "/statistics/tx_bytes");
  int64_t v = -1;
  in >> v;
  return v;
}

double max_over_ranks(cohort::Communicator& comm, double v) {
  auto t = torch::tensor({v}, torch::kFloat64);
  comm.all_reduce(t, {cohort::ReduceOp::Max}).wait();
  return t.item<double>();
}

template <typename Holder>
void run(const Args& a, Holder model, std::shared_ptr<cohort::Communicator> comm) {
  cohort::DistributedDataParallel<Holder> ddp(model, comm, a.ddp);
  torch::optim::SGD opt(ddp.parameters(), 0.01);
  auto [x, y] = cohort::bench::make_batch(a.model, a.batch);
  auto step = [&] {
    opt.zero_grad();
    auto out = ddp.forward(x);
    auto loss =
        a.model == "transformer" ? torch::mse_loss(out, y) : torch::cross_entropy_loss(out, y);
    loss.backward();
    opt.step();
  };
  for (int i = 0; i < a.warmup; ++i) step();
  std::vector<double> ms;
  comm->barrier().wait();
  const int64_t sent0 = link_tx_bytes();
  double counted = 0;  // DDPStats::bytes_sent: the communicator's count
  for (int i = 0; i < a.steps; ++i) {
    comm->barrier().wait();
    const auto t0 = std::chrono::steady_clock::now();
    step();
    const double own =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    counted += static_cast<double>(ddp.stats().bytes_sent);
    ms.push_back(max_over_ranks(*comm, own));
  }
  const int64_t sent1 = link_tx_bytes();
  const double engine_bytes = max_over_ranks(*comm, counted / a.steps);
  std::sort(ms.begin(), ms.end());
  const char* local = std::getenv("LOCAL_WORLD_SIZE");
  const int per_host = local ? std::max(1, std::atoi(local)) : 1;
  const double per_step =
      sent0 < 0 ? -1.0 : static_cast<double>(sent1 - sent0) / a.steps / per_host;
  if (comm->rank() == 0) {
    std::printf(
        "{\"engine\": \"cohort\", \"compressor\": \"%s\", \"model\": \"%s\", \"world\": %d, "
        "\"bytes_per_step\": %.0f, \"engine_bytes_per_step\": %.0f, \"step_ms\": %.2f}\n",
        a.compressor == "powersgd"
            ? ("powersgd_r" + std::to_string(a.ddp.compression.powersgd_rank)).c_str()
            : a.compressor.c_str(),
        a.model.c_str(), comm->size(), per_step, engine_bytes, ms[ms.size() / 2]);
    std::fflush(stdout);
  }
}

// --only compressor: Compressor::all_reduce alone, on random gradients laid
// out in buckets as DDP lays them out (parameters in reverse order, the
// first bucket closed at first_bucket_mb, the others at bucket_cap_mb), no
// forward or backward. Prints {"compressor", "model", "world",
// "compressor_ms"}: the median over timed steps of the slowest rank's sum
// over the buckets.
void run_compressor_only(const Args& a, torch::nn::Module& model, cohort::Communicator& comm) {
  auto params = model.parameters();
  std::reverse(params.begin(), params.end());
  struct Bucket {
    torch::Tensor flat, source;
    std::vector<torch::Tensor> shaped;
  };
  std::vector<Bucket> buckets;
  std::vector<torch::Tensor> open;
  int64_t bytes = 0;
  auto close = [&] {
    int64_t numel = 0;
    for (auto& p : open) numel += p.numel();
    Bucket b{torch::zeros({numel}), torch::randn({numel}) * 1e-3, {}};
    int64_t off = 0;
    for (auto& p : open) {
      b.shaped.push_back(b.flat.narrow(0, off, p.numel()).view(p.sizes()));
      off += p.numel();
    }
    buckets.push_back(std::move(b));
    open.clear();
    bytes = 0;
  };
  for (auto& p : params) {
    open.push_back(p);
    bytes += p.numel() * 4;
    const double cap = buckets.empty() ? a.ddp.first_bucket_mb : a.ddp.bucket_cap_mb;
    if (static_cast<double>(bytes) >= cap * 1024 * 1024) close();
  }
  if (!open.empty()) close();
  auto compressor = cohort::compression::make_compressor(a.ddp.compression);
  std::vector<double> ms;
  for (int i = 0; i < a.warmup + a.steps; ++i) {
    double own = 0;
    for (size_t k = 0; k < buckets.size(); ++k) {
      buckets[k].flat.copy_(buckets[k].source);
      const auto t0 = std::chrono::steady_clock::now();
      compressor->all_reduce(comm, buckets[k].flat, static_cast<int64_t>(k), buckets[k].shaped);
      own +=
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    const double slowest = max_over_ranks(comm, own);
    if (i >= a.warmup) ms.push_back(slowest);
  }
  std::sort(ms.begin(), ms.end());
  if (comm.rank() == 0) {
    std::printf(
        "{\"compressor\": \"%s\", \"model\": \"%s\", \"world\": %d, \"buckets\": %zu, "
        "\"compressor_ms\": %.2f}\n",
        a.compressor.c_str(), a.model.c_str(), comm.size(), buckets.size(), ms[ms.size() / 2]);
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  // The least PowerSGD accepts with error feedback and warm start: its two
  // uncompressed steps fall within the (untimed) warm-up.
  a.ddp.compression.powersgd_start_iteration = 2;
  CLI::App app{"compression_bench: one rank of a DDP training loop with gradient compression"};
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    a.ddp.compression.kind = cohort::compression::parse_compression_kind(a.compressor);
    torch::set_num_threads(1);
    auto comm = cohort::init();
    torch::manual_seed(comm->rank());
    if (a.only == "compressor") {
      auto stack = cohort::bench::TransformerStack();
      auto cnn = cohort::bench::make_cnn();
      auto mlp = cohort::bench::make_mlp();
      torch::nn::Module& m = a.model == "transformer" ? static_cast<torch::nn::Module&>(*stack)
                             : a.model == "cnn"       ? static_cast<torch::nn::Module&>(*cnn)
                                                      : static_cast<torch::nn::Module&>(*mlp);
      run_compressor_only(a, m, *comm);
    } else if (a.model == "mlp")
      run(a, cohort::bench::make_mlp(), comm);
    else if (a.model == "cnn")
      run(a, cohort::bench::make_cnn(), comm);
    else if (a.model == "transformer")
      run(a, cohort::bench::TransformerStack(), comm);
    else
      throw std::invalid_argument("unknown model " + a.model);
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::cerr << "compression_bench: " << e.what() << "\n";
    return 1;
  }
}
