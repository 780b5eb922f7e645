// pipeline_bench: every schedule at pp = world size, v in {1, 2}, m in
// {2, 4, 8, 16} on an MLP whose stages cost the same. Per row: the median
// step time, the measured bubble 1 - (time in compute actions) / (step
// time) averaged over ranks, the formula (p-1)/(v*m), and the simulator's
// step time from the costs measured in the same run (per action type,
// averaged over ranks and steps) and a measured point-to-point time, and its
// Monte Carlo mean with each action drawn from the run's measured durations.
// --json adds each rank's action-duration distribution per type and the
// host's steal, I/O wait and run-queue delays over the timed steps. Each
// row also gives every rank's peak activation memory in one step (counted
// by a MemoryScope) beside the memory model's prediction from each stage's
// measured StageMemory (schedule_memory).
//
//   cohortrun -n 2 -- build/bench/pipeline/pipeline_bench [--json]
//       [--width 384] [--batch 256] [--steps 7] [--blocks 4] [--schedule NAME] [--m M]
//       [--recv-window N]
#include <dirent.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "bench/cli.h"
#include "cohort/cohort.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "cohort/pipeline/schedule_simulator.h"

using namespace cohort;
using namespace cohort::pipeline;

namespace {

struct Args {
  bool json = false;
  int64_t width = 384, batch = 256;
  int steps = 7;
  int blocks = 4;             // Linear + Tanh blocks in the model, split evenly over pp * v stages
  std::string only_schedule;  // empty: every schedule
  int only_m = 0;             // 0: every m
  int recv_window = PipelineOptions{}.recv_window;
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Max (or sum) of a value over the ranks.
double reduce(Communicator& comm, double x, ReduceOp op) {
  auto t = torch::tensor({x}, torch::kFloat64);
  comm.all_reduce(t, {op}).wait();
  return t.item<double>();
}

// Half a round trip of `bytes` between ranks 0 and 1 (the others idle).
double p2p_ms(Communicator& comm, int64_t bytes) {
  auto t = torch::zeros({bytes / 4}, torch::kFloat32);
  std::vector<double> ms;
  for (int i = 0; i < 20; ++i) {
    comm.barrier().wait();
    auto t0 = std::chrono::steady_clock::now();
    if (comm.rank() == 0) {
      comm.send(t, 1, {7}).wait();
      comm.recv(t, 1, {8}).wait();
    } else if (comm.rank() == 1) {
      comm.recv(t, 0, {7}).wait();
      comm.send(t, 0, {8}).wait();
    }
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
        2);
  }
  return reduce(comm, median(ms), ReduceOp::Max);
}

// Where a rank's time goes besides its own work, over the timed steps:
// hypervisor steal and I/O wait of the whole machine (/proc/stat, ticks
// summed over CPUs), and for this process the main thread's time waiting on
// a run queue and its other threads' (Gloo's) CPU and run-queue time
// (/proc/self/task/*/schedstat: CPU ns, run-queue ns, slices).
struct HostCounters {
  double steal_ticks = 0, iowait_ticks = 0, all_ticks = 0;
  double main_wait_ms = 0, other_cpu_ms = 0, other_wait_ms = 0;
};

HostCounters read_host() {
  HostCounters h;
  std::ifstream stat("/proc/stat");
  std::string name;
  stat >> name;  // "cpu": the machine's totals
  for (int col = 0; col < 10; ++col) {
    double x = 0;
    stat >> x;
    h.all_ticks += x;
    if (col == 4) h.iowait_ticks = x;
    if (col == 7) h.steal_ticks = x;
  }
  const std::string main_tid = std::to_string(::getpid());
  if (DIR* d = ::opendir("/proc/self/task")) {
    while (dirent* e = ::readdir(d)) {
      if (e->d_name[0] == '.') continue;
      std::ifstream f(std::string("/proc/self/task/") + e->d_name + "/schedstat");
      double cpu_ns = 0, wait_ns = 0;
      if (!(f >> cpu_ns >> wait_ns)) continue;
      if (e->d_name == main_tid) {
        h.main_wait_ms += wait_ns / 1e6;
      } else {
        h.other_cpu_ms += cpu_ns / 1e6;
        h.other_wait_ms += wait_ns / 1e6;
      }
    }
    ::closedir(d);
  }
  return h;
}

// Rank `root`'s `samples` on every rank.
std::vector<double> share(Communicator& comm, const std::vector<double>& samples, int root) {
  BroadcastOptions opts;
  opts.root = root;
  auto n = torch::tensor({static_cast<int64_t>(samples.size())}, torch::kInt64);
  comm.broadcast(n, opts).wait();
  auto t = comm.rank() == root ? torch::tensor(samples, torch::kFloat64)
                               : torch::empty({n.item<int64_t>()}, torch::kFloat64);
  if (t.numel() > 0) comm.broadcast(t, opts).wait();
  return std::vector<double>(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
}

// {"rank": r, "type": "F", "n": .., "mean": .., "cv": .., "p50": .., ...}
std::string jitter_json(int rank, ActionType type, std::vector<double> v) {
  if (v.empty()) return "";
  std::sort(v.begin(), v.end());
  double mean = 0, var = 0;
  for (double x : v) mean += x / v.size();
  for (double x : v) var += (x - mean) * (x - mean) / v.size();
  auto pct = [&](double q) { return v[std::min(v.size() - 1, size_t(q * v.size()))]; };
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "{\"rank\": %d, \"type\": \"%s\", \"n\": %zu, \"mean\": %.3f, \"cv\": %.3f, "
                "\"p10\": %.3f, \"p50\": %.3f, \"p90\": %.3f, \"p99\": %.3f, \"max\": %.3f}",
                rank, action_type_name(type), v.size(), mean, mean > 0 ? std::sqrt(var) / mean : 0,
                pct(0.1), pct(0.5), pct(0.9), pct(0.99), v.back());
  return buf;
}

// Per rank: the peak bytes of one step (gradients zeroed in place, so that
// only what the step holds counts) and the model's prediction from each
// stage measured on one micro-batch.
struct MemoryRow {
  std::vector<double> measured, predicted, live;
};

MemoryRow measure_memory(Communicator& comm, PipelineRuntime& rt, const Tensors& x,
                         const Tensors& y, int m) {
  const PipelineSchedule& schedule = rt.schedule();
  const int pp = comm.size(), stages = schedule.num_stages;
  const int64_t rows = x[0].size(0) / m;
  // Each rank measures its stages; a sum over ranks gives every stage.
  auto costs = torch::zeros({stages, 6}, torch::kFloat64);
  for (const PipelineStage& st : rt.stages()) {
    std::function<torch::Tensor(const Tensors&)> loss;
    if (st.index() == stages - 1)
      loss = [&](const Tensors& out) {
        return torch::nn::functional::mse_loss(out[0], y[0].narrow(0, 0, rows)) / m;
      };
    Tensors in{st.index() == 0 ? x[0].narrow(0, 0, rows)
                               : torch::randn_like(x[0].narrow(0, 0, rows))};
    StageMemory sm = measure_stage_memory(st, in, loss);
    costs[st.index()] =
        torch::tensor({double(sm.activation_bytes), double(sm.split_activation_bytes),
                       double(sm.workspace_bytes), double(sm.input_workspace_bytes),
                       double(sm.weight_workspace_bytes), double(sm.weight_pending_bytes)},
                      torch::kFloat64);
  }
  comm.all_reduce(costs, {ReduceOp::Sum}).wait();
  MemoryCosts mc;
  mc.stages.clear();
  for (int st = 0; st < stages; ++st) {
    auto c = costs[st];
    mc.stages.push_back({int64_t(c[0].item<double>()), int64_t(c[1].item<double>()),
                         int64_t(c[2].item<double>()), int64_t(c[3].item<double>()),
                         int64_t(c[4].item<double>()), int64_t(c[5].item<double>())});
  }
  mc.boundary_bytes = {rows * x[0].size(1) * int64_t{sizeof(float)}};
  const ScheduleMemory predicted = schedule_memory(schedule, mc);
  for (auto& p : rt.parameters()) p.mutable_grad() = torch::zeros_like(p);
  auto measured = torch::zeros({2, pp}, torch::kFloat64);
  {
    memory::MemoryScope scope;
    auto r = rt.step(x, y);
    measured[0][comm.rank()] = double(scope.peak_bytes());
    measured[1][comm.rank()] = r.peak_live_microbatches;
  }
  comm.all_reduce(measured, {ReduceOp::Sum}).wait();
  MemoryRow row;
  for (int r = 0; r < pp; ++r) {
    row.measured.push_back(measured[0][r].item<double>());
    row.live.push_back(measured[1][r].item<double>());
    row.predicted.push_back(double(predicted.peak_bytes[r]));
  }
  return row;
}

std::string join(const std::vector<double>& v, double scale, const char* fmt) {
  std::string out;
  char buf[32];
  for (double x : v) {
    std::snprintf(buf, sizeof buf, fmt, x * scale);
    out += (out.empty() ? "" : ", ") + std::string(buf);
  }
  return out;
}

void run_row(std::shared_ptr<Communicator> comm, const Args& args, const std::string& name, int v,
             int m) {
  const int pp = comm->size();
  auto schedule = make_schedule(name, pp, v, m);
  const int stages = pp * v;
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int b = 0; b < args.blocks; ++b) {
    model->push_back(torch::nn::Linear(args.width, args.width));
    model->push_back(torch::nn::Tanh());
  }
  const int64_t layers = static_cast<int64_t>(model->size());
  std::vector<int64_t> bounds;
  for (int s = 1; s < stages; ++s) bounds.push_back(s * layers / stages);
  std::vector<PipelineStage> mine;
  for (int s : schedule.stages_of(comm->rank()))
    mine.emplace_back(s, split_sequential(model, bounds, s));
  auto loss = [](const Tensors& out, const Tensors& y) {
    return torch::nn::functional::mse_loss(out[0], y[0]);
  };
  PipelineOptions options;
  options.recv_window = args.recv_window;
  PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, loss,
                     options);
  auto x = torch::randn({args.batch, args.width}), y = torch::randn({args.batch, args.width});

  std::vector<double> step, bubble;
  std::map<ActionType, double> ms, count;
  std::map<ActionType, std::vector<double>> durations;  // this rank's, per type
  // The runtime's schedule: the generator's plus the send and receive actions.
  const auto& my_actions = rt.schedule().actions[comm->rank()];
  HostCounters before;
  for (int i = 0; i < args.steps + 2; ++i) {
    if (i == 2) before = read_host();
    comm->barrier().wait();
    auto r = rt.step({x}, {y});
    for (auto& p : rt.parameters()) p.mutable_grad() = torch::Tensor();
    if (i < 2) continue;  // warm-up
    double s = reduce(*comm, r.step_ms, ReduceOp::Max);
    step.push_back(s);
    bubble.push_back(reduce(*comm, 1 - r.compute_ms / s, ReduceOp::Sum) / pp);
    for (auto& [t, v2] : r.action_ms) ms[t] += v2, count[t] += r.action_count[t];
    for (size_t k = 0; k < r.durations_ms.size() && k < my_actions.size(); ++k)
      durations[my_actions[k].type].push_back(r.durations_ms[k]);
  }
  const HostCounters after = read_host();
  // Per step: the machine's steal and I/O wait (ticks of 1/100 s over both
  // CPUs, as ms), each rank's run-queue waits and its other threads' CPU.
  const double per = 1.0 / args.steps, tick_ms = 1000.0 / ::sysconf(_SC_CLK_TCK);
  const double steal_ms = (after.steal_ticks - before.steal_ticks) * tick_ms * per;
  const double iowait_ms = (after.iowait_ticks - before.iowait_ticks) * tick_ms * per;
  const double steal_frac =
      (after.steal_ticks - before.steal_ticks) / std::max(1.0, after.all_ticks - before.all_ticks);
  std::string host_by_rank;
  for (int r = 0; r < pp; ++r) {
    const bool me = comm->rank() == r;
    auto of = [&](double a, double b) {
      return reduce(*comm, me ? (a - b) * per : 0, ReduceOp::Sum);
    };
    char buf[200];
    std::snprintf(buf, sizeof buf,
                  "%s{\"rank\": %d, \"main_runq_ms\": %.3f, \"other_threads_cpu_ms\": %.3f, "
                  "\"other_threads_runq_ms\": %.3f}",
                  r ? ", " : "", r, of(after.main_wait_ms, before.main_wait_ms),
                  of(after.other_cpu_ms, before.other_cpu_ms),
                  of(after.other_wait_ms, before.other_wait_ms));
    host_by_rank += buf;
  }
  // Every rank's action durations per type, on every rank.
  const ActionType kTypes[] = {ActionType::Forward,       ActionType::Backward,
                               ActionType::BackwardInput, ActionType::BackwardWeight,
                               ActionType::RecvForward,   ActionType::RecvBackward};
  std::vector<std::map<ActionType, std::vector<double>>> samples(pp);
  for (int r = 0; r < pp; ++r)
    for (ActionType t : kTypes) samples[r][t] = share(*comm, durations[t], r);
  std::string jitter;
  for (int r = 0; r < pp; ++r)
    for (ActionType t : kTypes) {
      std::string j = jitter_json(r, t, samples[r][t]);
      if (!j.empty()) jitter += (jitter.empty() ? "" : ", ") + j;
    }
  std::vector<double> sorted_steps = step;
  std::sort(sorted_steps.begin(), sorted_steps.end());
  // Mean cost per action type over the ranks and steps.
  // Mean cost per action type on each rank, over its stages and the steps:
  // stages are not equal (the first skips its input's gradient, the last
  // adds the loss), and the simulator needs the slower ones.
  std::vector<StageCosts> rank_costs(pp);
  for (int r = 0; r < pp; ++r) {
    auto mean = [&](ActionType t) {
      const bool me = comm->rank() == r;
      double a = reduce(*comm, me ? ms[t] : 0, ReduceOp::Sum);
      double n = reduce(*comm, me ? count[t] : 0, ReduceOp::Sum);
      return n > 0 ? a / n : 0.0;
    };
    rank_costs[r].forward_ms = mean(ActionType::Forward);
    rank_costs[r].backward_ms = mean(ActionType::Backward);
    rank_costs[r].backward_input_ms = mean(ActionType::BackwardInput);
    rank_costs[r].backward_weight_ms = mean(ActionType::BackwardWeight);
  }
  StageCosts c{0, 0, 0, 0};  // the mean over ranks, for the report
  for (const auto& rc : rank_costs) {
    c.forward_ms += rc.forward_ms / pp, c.backward_ms += rc.backward_ms / pp;
    c.backward_input_ms += rc.backward_input_ms / pp;
    c.backward_weight_ms += rc.backward_weight_ms / pp;
  }
  // Per step and rank: time in send and receive actions, and in neither
  // (splitting the batch, waiting for the last sends, the loss broadcast).
  auto per_step = [&](double x) { return reduce(*comm, x, ReduceOp::Sum) / (pp * args.steps); };
  const double send_ms = per_step(ms[ActionType::SendForward] + ms[ActionType::SendBackward]);
  const double recv_ms = per_step(ms[ActionType::RecvForward] + ms[ActionType::RecvBackward]);
  double in_actions = 0;
  for (auto& [t, v2] : ms) in_actions += v2;
  double step_sum = 0;
  for (double x : step) step_sum += x;
  const double other_ms = per_step(step_sum) - per_step(in_actions);
  SimulatorCosts sc;
  sc.stages.clear();
  for (int st = 0; st < stages; ++st) sc.stages.push_back(rank_costs[schedule.stage_to_rank[st]]);
  const int64_t bytes = args.batch / m * args.width * 4;
  const double t_p2p = p2p_ms(*comm, bytes);
  sc.boundary_bytes = {bytes};
  sc.transfer_ms = [t_p2p](int64_t) { return t_p2p; };
  auto sim = simulate_schedule(schedule, sc);
  const MemoryRow mem = measure_memory(*comm, rt, {x}, {y}, m);
  if (comm->rank() != 0) return;
  // The same with each action's cost drawn from its rank's measured
  // durations of that type (this run's empirical distribution).
  std::vector<StageCostSamples> stage_samples;
  for (int st = 0; st < stages; ++st) {
    auto& smp = samples[schedule.stage_to_rank[st]];
    stage_samples.push_back({smp[ActionType::Forward], smp[ActionType::Backward],
                             smp[ActionType::BackwardInput], smp[ActionType::BackwardWeight]});
  }
  auto mc = simulate_schedule_monte_carlo(schedule, sc, stage_samples, 2000);
  // No (p-1)/(v*m) for ZB-H1: its bubble depends on the I/W split.
  const bool has_formula = name != "zbh1";
  const double formula = double(pp - 1) / (v * m);
  char formula_text[32];
  std::snprintf(formula_text, sizeof formula_text, has_formula ? "%.4f" : "null", formula);
  const double step_ms = median(step), bub = median(bubble);
  std::string by_rank;  // F and B (or I + W) per rank, to see unequal stages
  for (const auto& rc : rank_costs)
    by_rank += (by_rank.empty() ? "" : ", ") + std::to_string(rc.forward_ms) + ", " +
               std::to_string(rc.backward_ms + rc.backward_input_ms + rc.backward_weight_ms);
  if (args.json)
    std::printf(
        "{\"schedule\": \"%s\", \"pp\": %d, \"v\": %d, \"m\": %d, \"step_ms\": %.3f, "
        "\"bubble_measured\": %.4f, \"bubble_formula\": %s, \"predicted_ms\": %.3f, "
        "\"f_ms\": %.3f, \"b_ms\": %.3f, \"i_ms\": %.3f, \"w_ms\": %.3f, \"p2p_ms\": %.3f, "
        "\"sim_bubble\": %.4f, \"send_ms\": %.3f, \"recv_ms\": %.3f, \"other_ms\": %.3f, "
        "\"fb_ms_by_rank\": [%s], \"step_min_ms\": %.3f, \"step_max_ms\": %.3f, "
        "\"steal_ms\": %.3f, \"steal_frac\": %.4f, \"iowait_ms\": %.3f, \"host_by_rank\": [%s], "
        "\"predicted_mc_ms\": %.3f, \"mc_p10_ms\": %.3f, \"mc_p90_ms\": %.3f, "
        "\"mc_bubble\": %.4f, \"peak_bytes\": [%s], \"predicted_peak_bytes\": [%s], "
        "\"peak_live_microbatches\": [%s], \"jitter\": [%s]}\n",
        name.c_str(), pp, v, m, step_ms, bub, formula_text, sim.step_ms, c.forward_ms,
        c.backward_ms, c.backward_input_ms, c.backward_weight_ms, t_p2p, sim.bubble_fraction,
        send_ms, recv_ms, other_ms, by_rank.c_str(), sorted_steps.front(), sorted_steps.back(),
        steal_ms, steal_frac, iowait_ms, host_by_rank.c_str(), mc.mean_step_ms, mc.p10_step_ms,
        mc.p90_step_ms, mc.mean_bubble_fraction, join(mem.measured, 1, "%.0f").c_str(),
        join(mem.predicted, 1, "%.0f").c_str(), join(mem.live, 1, "%.0f").c_str(), jitter.c_str());
  else
    std::printf(
        "%-12s pp %d v %d m %2d  step %8.2f ms  bubble %.3f (formula %.3f)  predicted "
        "%8.2f ms (%+.1f%%)  Monte Carlo %8.2f ms (%+.1f%%)  peak MiB by rank [%s] predicted "
        "[%s]\n",
        name.c_str(), pp, v, m, step_ms, bub, formula, sim.step_ms,
        100 * (sim.step_ms - step_ms) / step_ms, mc.mean_step_ms,
        100 * (mc.mean_step_ms - step_ms) / step_ms,
        join(mem.measured, 1.0 / (1 << 20), "%.2f").c_str(),
        join(mem.predicted, 1.0 / (1 << 20), "%.2f").c_str());
  std::fflush(stdout);
}

// Flags as docs/benchmarks.md and compare.sh pass them; --help lists them
// with their defaults.
void add_flags(CLI::App& app, Args& args) {
  cohort::bench::show_defaults(app);
  app.add_flag("--json", args.json, "one JSON object per row, with the jitter and host figures");
  app.add_option("--width", args.width, "features of every Linear")
      ->check(cohort::bench::positive());
  app.add_option("--batch", args.batch, "global batch (rows), split into m micro-batches")
      ->check(cohort::bench::positive());
  app.add_option("--steps", args.steps, "timed steps per row (after 2 warm-up steps)")
      ->check(cohort::bench::positive());
  app.add_option("--blocks", args.blocks, "Linear + Tanh blocks, split evenly over the stages")
      ->check(cohort::bench::positive());
  app.add_option("--schedule", args.only_schedule, "only this schedule (default: every one)")
      ->check(CLI::IsMember({"gpipe", "1f1b", "zbh1", "interleaved"}));
  app.add_option("--m", args.only_m, "only this number of micro-batches (0: every one)")
      ->check(CLI::IsMember({0, 2, 4, 8, 16}));
  app.add_option("--recv-window", args.recv_window, "PipelineOptions::recv_window")
      ->check(cohort::bench::non_negative());
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  CLI::App app{"pipeline_bench: step time, bubble and memory of every pipeline schedule"};
  add_flags(app, args);
  CLI11_PARSE(app, argc, argv);
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    auto wanted = [&](const std::string& s, int m) {
      return (args.only_schedule.empty() || args.only_schedule == s) &&
             (args.only_m == 0 || args.only_m == m);
    };
    for (int m : {2, 4, 8, 16}) {
      for (const char* s : {"gpipe", "1f1b", "zbh1"})
        if (wanted(s, m)) run_row(comm, args, s, 1, m);
      for (int v : {1, 2})
        if (m % comm->size() == 0 && wanted("interleaved", m))
          run_row(comm, args, "interleaved", v, m);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_bench: %s\n", e.what());
    return 1;
  }
  return 0;
}
