// One rank of the async checkpoint benchmark (run under cohortrun):
//
//   cohortrun -n 2 -- async_save_bench [--every 5] [--saves 4] [--rounds 5] DIR
//
// A data-parallel GPT (examples/models/gpt_model.h, tp = pp = 1, AdamW, the
// gradients averaged with one all-reduce of their concatenation) trains
// (saves + 1) * every steps per run, saving a checkpoint of its whole state
// (dcp::get_state_dict: model and AdamW state) every `every` steps, in three
// modes: none, blocking (dcp::save) and async (dcp::async_save; the next
// step's forward and backward run while it stages, wait_staged() before
// that step's optimizer step; committed by the next save or at the run's
// end). Each round runs every mode once, the order rotated from round to
// round. Rank 0 prints each run, then per mode the medians of:
// - the run, barrier to barrier: pause per save = (run − none's) / saves;
// - the window of each save: from the save call to the end of the next
//   step (for none, that step alone), where a save's cost lands unless the
//   writer thread slows later steps; shorter than a run, so less noisy;
// - the time the training thread spent inside the save calls,
//   wait_staged() and the last wait() (async's also by part),
// and each as async's overhead over blocking's, (async − none) /
// (blocking − none) (the bar: at most 0.05).
#include <malloc.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "cohort/dcp/async_save.h"
#include "examples/models/gpt_model.h"

namespace {

using namespace cohort;
using namespace cohort::tensor_parallel;

struct Args {
  int64_t layers = 4, hidden = 256, seq = 32, batch = 4, vocab = 2048;
  int every = 5, saves = 4, rounds = 5;
  std::string dir;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct Job {
  GPTStage model{nullptr};
  std::unique_ptr<torch::optim::AdamW> opt;
  torch::Tensor ids, targets;
  dcp::StateDictOptions layout;  // the mesh the stage's tensor-parallel layers were built on
  // Kept from run to run, as a training loop keeps it: the next save reuses
  // its staging memory.
  dcp::AsyncSave pending;
};

// One training step; `before_step` runs between backward and the optimizer.
template <typename BeforeStep>
void step(Job& j, Communicator& comm, BeforeStep&& before_step) {
  j.opt->zero_grad();
  j.model->loss(j.model(j.ids), j.targets).backward();
  std::vector<torch::Tensor> grads;
  for (auto& p : j.model->parameters()) grads.push_back(p.grad().view(-1));
  auto flat = torch::cat(grads);
  comm.all_reduce(flat).wait();
  flat.div_(comm.size());
  int64_t at = 0;
  for (auto& p : j.model->parameters()) {
    p.mutable_grad().view(-1).copy_(flat.narrow(0, at, p.numel()));
    at += p.numel();
  }
  before_step();
  j.opt->step();
}

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Where the time inside the calls goes (async): get_state_dict, the
// async_save call (with the commit of the previous save), wait_staged()
// and the run's last wait().
enum Part { kStateDict, kCall, kStaged, kLast, kParts };
const char* const kPartNames[kParts] = {"get_state_dict", "the call", "wait_staged", "last wait"};

struct Timing {
  double run = 0;              // the run, barrier to barrier
  double inside = 0;           // in the save calls, wait_staged() and the last wait()
  double part[kParts] = {};    // async: `inside` by part
  std::vector<double> window;  // per save: the call and the next step
};

// One run of `mode`: 0 none, 1 blocking, 2 async.
Timing run(Job& j, Communicator& comm, const Args& a, int mode, int round) {
  const auto base = std::filesystem::path(a.dir) / ("r" + std::to_string(round));
  std::filesystem::create_directories(base);
  comm.barrier().wait();
  const auto t0 = std::chrono::steady_clock::now();
  Timing t;
  std::chrono::steady_clock::time_point window_start;
  bool in_window = false;
  for (int s = 1; s <= (a.saves + 1) * a.every; ++s) {
    step(j, comm, [&] {
      if (mode != 2 || !in_window) return;
      const auto in = std::chrono::steady_clock::now();
      j.pending.wait_staged();
      t.part[kStaged] += since(in);
      t.inside += since(in);
    });
    if (in_window) t.window.push_back(since(window_start));
    in_window = s % a.every == 0 && s <= a.saves * a.every;
    if (!in_window) continue;
    window_start = std::chrono::steady_clock::now();
    if (mode == 0) continue;
    const auto dir = (base / ("m" + std::to_string(mode) + "-" + std::to_string(s))).string();
    if (mode == 1) {
      dcp::save(dcp::get_state_dict(*j.model, *j.opt, j.layout), dir, comm);
    } else {
      auto state = dcp::get_state_dict(*j.model, *j.opt, j.layout);
      const auto got = std::chrono::steady_clock::now();
      j.pending = dcp::async_save(state, dir, comm);
      t.part[kStateDict] += std::chrono::duration<double>(got - window_start).count();
      t.part[kCall] += since(got);
    }
    t.inside += since(window_start);
  }
  const auto in = std::chrono::steady_clock::now();
  j.pending.wait();
  t.part[kLast] += since(in);
  t.inside += since(in);
  comm.barrier().wait();
  t.run = since(t0);
  return t;
}

void add_flags(CLI::App& app, Args& a) {
  cohort::bench::show_defaults(app);
  app.add_option("--layers", a.layers, "transformer blocks")->check(cohort::bench::positive());
  app.add_option("--hidden", a.hidden, "model width")->check(cohort::bench::positive());
  app.add_option("--vocab", a.vocab, "vocabulary")->check(cohort::bench::positive());
  app.add_option("--seq", a.seq, "sequence length")->check(cohort::bench::positive());
  app.add_option("--batch", a.batch, "sequences per rank and step")
      ->check(cohort::bench::positive());
  app.add_option("--every", a.every, "steps between saves")->check(cohort::bench::positive());
  app.add_option("--saves", a.saves, "saves per run")->check(cohort::bench::positive());
  app.add_option("--rounds", a.rounds, "rounds of one run per mode")
      ->check(cohort::bench::positive());
  app.add_option("DIR", a.dir, "folder the checkpoints are written to")->required();
}

// Per mode, a median and its excess over none's; async's over blocking's.
void report_line(const char* what, double none, double blocking, double async) {
  std::printf("%s: none %.4f, blocking %.4f, async %.4f; async overhead / blocking's %.3f\n", what,
              none, blocking, async, (async - none) / (blocking - none));
}

void report(const Args& a, const std::vector<double> (&t)[3],
            const std::vector<double> (&inside)[3], const std::vector<double> (&window)[3],
            const std::vector<double> (&parts)[kParts]) {
  const int steps = (a.saves + 1) * a.every;
  report_line("median s/step (runs)", median(t[0]) / steps, median(t[1]) / steps,
              median(t[2]) / steps);
  report_line("median save window s (call + next step)", median(window[0]), median(window[1]),
              median(window[2]));
  report_line("median s per save inside the calls (rank 0)", 0, median(inside[1]),
              median(inside[2]));
  std::printf("async, median s per save by part:");
  for (int p = 0; p < kParts; ++p) std::printf(" %s %.4f", kPartNames[p], median(parts[p]));
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  CLI::App app{"async_save_bench: step time with no, blocking and async checkpoints"};
  add_flags(app, a);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    // A fixed mmap threshold for every mode: glibc raises it when a large
    // block is freed (a save's staging memory), after which the steps'
    // temporaries come from the heap instead of fresh mmapped pages, and
    // every run after a save would step faster than one without.
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    auto comm = init();
    auto mesh = init_device_mesh(comm, {1, comm->size(), 1}, {"pp", "dp", "tp"});
    GPTConfig c;
    c.vocab_size = a.vocab, c.seq_len = a.seq, c.hidden = a.hidden, c.heads = 4;
    c.layers = a.layers;
    Job j{GPTStage(mesh, c), nullptr, {}, {}, {}, {}};
    j.layout.mesh = &mesh;
    j.opt = std::make_unique<torch::optim::AdamW>(j.model->parameters(),
                                                  torch::optim::AdamWOptions(1e-4));
    torch::manual_seed(comm->rank());
    j.ids = torch::randint(c.vocab_size, {a.batch, c.seq_len}, torch::kInt64);
    j.targets = (j.ids * 5 + 3) % c.vocab_size;
    step(j, *comm, [] {});  // AdamW's state exists from here on
    int64_t numel = 0;
    for (const auto& p : j.model->parameters()) numel += p.numel();
    if (comm->rank() == 0) {
      std::printf(
          "GPT of %lld parameters (%.1f MiB with AdamW state), world %d, a save every "
          "%d steps\n",
          static_cast<long long>(numel), numel * 12.0 / (1 << 20), comm->size(), a.every);
    }
    const char* names[] = {"none", "blocking", "async"};
    std::vector<double> t[3], inside[3], window[3], parts[kParts];
    for (int round = 0; round < a.rounds; ++round) {
      for (int k = 0; k < 3; ++k) {
        const int mode = (round + k) % 3;
        const auto timing = run(j, *comm, a, mode, round);
        t[mode].push_back(timing.run);
        inside[mode].push_back(timing.inside / a.saves);
        window[mode].insert(window[mode].end(), timing.window.begin(), timing.window.end());
        if (mode == 2) {
          for (int p = 0; p < kParts; ++p) parts[p].push_back(timing.part[p] / a.saves);
        }
        if (comm->rank() == 0) {
          std::printf("round %d %-8s %.4f s, %.4f s per save in the calls, windows", round,
                      names[mode], timing.run, inside[mode].back());
          for (double w : timing.window) std::printf(" %.4f", w);
          if (mode == 2) {
            std::printf("; per save");
            for (int p = 0; p < kParts; ++p) {
              std::printf(" %s %.4f", kPartNames[p], parts[p].back());
            }
          }
          std::printf("\n");
        }
      }
      // This round's folder only: the next round's may be in the making.
      comm->barrier().wait();
      if (comm->rank() == 0) {
        std::filesystem::remove_all(std::filesystem::path(a.dir) / ("r" + std::to_string(round)));
      }
    }
    if (comm->rank() == 0) report(a, t, inside, window, parts);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "async_save_bench: %s\n", e.what());
    return 1;
  }
}
