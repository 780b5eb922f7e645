// One rank of the checkpoint save benchmark (run under cohortrun, which sets
// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT):
//
//   cohortrun -n 4 -- dcp_save_bench MODE RUNS DIR
//
// MODE zero2: a ZeRO-2 AdamW job; today's checkpoint is what the Trainer
// writes: rank 0 the model (model->save into an archive, one checkpoint
// file), every rank its ZeRO shard (save_shard, one checkpoint file).
// MODE ddp: a replicated AdamW job; today rank 0 writes model and
// optimizer (one checkpoint file). Against both: dcp::save of the same
// state. The two alternate RUNS times; each save is timed from a barrier
// to a barrier (the slowest rank's time). Rank 0 prints one line per run
// and the medians and their ratio.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "cohort/dcp/checkpoint_file.h"  // the replicated file it compares against

namespace {

// 8 Linear layers of 1024 x 1024: 8.4 M parameters, 32 MiB of fp32.
torch::nn::Sequential model() {
  torch::nn::Sequential seq;
  for (int i = 0; i < 8; ++i) seq->push_back(torch::nn::Linear(1024, 1024));
  return seq;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

template <typename F>
double timed(cohort::Communicator& comm, F&& f) {
  comm.barrier().wait();
  const auto t0 = std::chrono::steady_clock::now();
  f();
  comm.barrier().wait();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string archive_bytes(torch::serialize::OutputArchive& archive) {
  std::ostringstream out;
  archive.save_to(out);
  return out.str();
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode;
  int runs = 0;
  std::string dir_text;
  CLI::App app{"dcp_save_bench: checkpoint save time, dcp::save against per-rank files"};
  app.add_option("MODE", mode, "zero2 | ddp")->required()->check(CLI::IsMember({"zero2", "ddp"}));
  app.add_option("RUNS", runs, "alternating runs of each side")
      ->required()
      ->check(cohort::bench::positive());
  app.add_option("DIR", dir_text, "folder the checkpoints are written to")->required();
  CLI11_PARSE(app, argc, argv);
  try {
    const std::filesystem::path dir = dir_text;
    torch::set_num_threads(1);
    auto comm = cohort::init();
    torch::manual_seed(0);
    auto net = model();
    const auto opts = torch::optim::AdamWOptions(1e-4);
    std::unique_ptr<cohort::ZeroRedundancyOptimizer> zero;
    std::unique_ptr<torch::optim::AdamW> adamw;
    if (mode == "zero2") {
      cohort::ZeroOptions zo;
      zo.stage = 2;
      zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(net->parameters(), comm,
                                                                        opts, zo);
    } else {
      adamw = std::make_unique<torch::optim::AdamW>(net->parameters(), opts);
    }
    // One step, so that every optimizer holds its state.
    net->forward(torch::randn({4, 1024})).pow(2).mean().backward();
    if (zero) {
      zero->step();
    } else {
      adamw->step();
    }
    const auto r = comm->rank();
    std::filesystem::create_directories(dir);
    auto today = [&] {
      if (r == 0) {
        torch::serialize::OutputArchive archive, m;
        net->save(m);
        archive.write("model", m);
        if (adamw) {
          torch::serialize::OutputArchive o;
          adamw->save(o);
          archive.write("optimizer", o);
        }
        cohort::write_checkpoint_file((dir / "checkpoint.pt").string(), archive_bytes(archive));
      }
      if (zero) {
        torch::serialize::OutputArchive shard;
        zero->save_shard(shard);
        cohort::write_checkpoint_file((dir / ("shard_" + std::to_string(r) + ".pt")).string(),
                                      archive_bytes(shard));
      }
    };
    auto distributed = [&] {
      auto sd = zero ? cohort::dcp::get_state_dict(*net, *zero)
                     : cohort::dcp::get_state_dict(*net, *adamw);
      cohort::dcp::save(sd, (dir / "dcp").string(), *comm);
    };
    std::vector<double> a, b;
    for (int i = 0; i < runs; ++i) {
      // Alternate which goes first, so neither always meets a warm cache.
      if (i % 2 == 0) {
        a.push_back(timed(*comm, today));
        b.push_back(timed(*comm, distributed));
      } else {
        b.push_back(timed(*comm, distributed));
        a.push_back(timed(*comm, today));
      }
      if (r == 0) std::printf("run %d  today %.4f s  dcp %.4f s\n", i, a.back(), b.back());
    }
    if (r == 0) {
      std::printf("%s world %d: median today %.4f s, dcp %.4f s, dcp/today %.2f\n", mode.c_str(),
                  comm->size(), median(a), median(b), median(b) / median(a));
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcp_save_bench: %s\n", e.what());
    return 1;
  }
}
