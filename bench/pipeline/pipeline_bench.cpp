// pipeline_bench: every schedule at pp = world size, v in {1, 2}, m in
// {2, 4, 8, 16} on an MLP whose stages cost the same. Per row: the median
// step time, the measured bubble 1 - (time in compute actions) / (step
// time) averaged over ranks, the formula (p-1)/(v*m), and the simulator's
// step time from the costs measured in the same run (per action type,
// averaged over ranks and steps) and a measured point-to-point time.
//
//   cohortrun -n 2 -- build/bench/pipeline/pipeline_bench [--json]
//       [--width 384] [--batch 256] [--steps 7] [--schedule NAME] [--m M]
#include <torch/torch.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>

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
  std::string only_schedule;  // empty: every schedule
  int only_m = 0;             // 0: every m
};

constexpr int kBlocks = 4;  // Linear + Tanh blocks in the model, v = 1 or 2 per rank split

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

void run_row(std::shared_ptr<Communicator> comm, const Args& args, const std::string& name, int v,
             int m) {
  const int pp = comm->size();
  auto schedule = make_schedule(name, pp, v, m);
  const int stages = pp * v;
  torch::manual_seed(0);
  torch::nn::Sequential model;
  for (int b = 0; b < kBlocks * pp / 2; ++b) {
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
  PipelineRuntime rt(comm, std::move(mine), schedule, loss);
  auto x = torch::randn({args.batch, args.width}), y = torch::randn({args.batch, args.width});

  std::vector<double> step, bubble;
  std::map<ActionType, double> ms, count;
  for (int i = 0; i < args.steps + 2; ++i) {
    comm->barrier().wait();
    auto r = rt.step({x}, {y});
    for (auto& p : rt.parameters()) p.mutable_grad() = torch::Tensor();
    if (i < 2) continue;  // warm-up
    double s = reduce(*comm, r.step_ms, ReduceOp::Max);
    step.push_back(s);
    bubble.push_back(reduce(*comm, 1 - r.compute_ms / s, ReduceOp::Sum) / pp);
    for (auto& [t, v2] : r.action_ms) ms[t] += v2, count[t] += r.action_count[t];
  }
  // Mean cost per action type over the ranks and steps.
  StageCosts c;
  auto mean = [&](ActionType t) {
    double a = reduce(*comm, ms[t], ReduceOp::Sum), n = reduce(*comm, count[t], ReduceOp::Sum);
    return n > 0 ? a / n : 0.0;
  };
  c.forward_ms = mean(ActionType::Forward);
  c.backward_ms = mean(ActionType::Backward);
  c.backward_input_ms = mean(ActionType::BackwardInput);
  c.backward_weight_ms = mean(ActionType::BackwardWeight);
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
  sc.stages = {c};
  const int64_t bytes = args.batch / m * args.width * 4;
  const double t_p2p = p2p_ms(*comm, bytes);
  sc.boundary_bytes = {bytes};
  sc.transfer_ms = [t_p2p](int64_t) { return t_p2p; };
  auto sim = simulate_schedule(schedule, sc);
  if (comm->rank() != 0) return;
  // No (p-1)/(v*m) for ZB-H1: its bubble depends on the I/W split.
  const bool has_formula = name != "zbh1";
  const double formula = double(pp - 1) / (v * m);
  char formula_text[32];
  std::snprintf(formula_text, sizeof formula_text, has_formula ? "%.4f" : "null", formula);
  const double step_ms = median(step), bub = median(bubble);
  if (args.json)
    std::printf(
        "{\"schedule\": \"%s\", \"pp\": %d, \"v\": %d, \"m\": %d, \"step_ms\": %.3f, "
        "\"bubble_measured\": %.4f, \"bubble_formula\": %s, \"predicted_ms\": %.3f, "
        "\"f_ms\": %.3f, \"b_ms\": %.3f, \"i_ms\": %.3f, \"w_ms\": %.3f, \"p2p_ms\": %.3f, "
        "\"sim_bubble\": %.4f, \"send_ms\": %.3f, \"recv_ms\": %.3f, \"other_ms\": %.3f}\n",
        name.c_str(), pp, v, m, step_ms, bub, formula_text, sim.step_ms, c.forward_ms,
        c.backward_ms, c.backward_input_ms, c.backward_weight_ms, t_p2p, sim.bubble_fraction,
        send_ms, recv_ms, other_ms);
  else
    std::printf(
        "%-12s pp %d v %d m %2d  step %8.2f ms  bubble %.3f (formula %.3f)  predicted "
        "%8.2f ms (%+.1f%%)\n",
        name.c_str(), pp, v, m, step_ms, bub, formula, sim.step_ms,
        100 * (sim.step_ms - step_ms) / step_ms);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&] { return i + 1 < argc ? std::string(argv[++i]) : std::string("0"); };
    if (a == "--json")
      args.json = true;
    else if (a == "--width")
      args.width = std::stoll(next());
    else if (a == "--batch")
      args.batch = std::stoll(next());
    else if (a == "--steps")
      args.steps = std::stoi(next());
    else if (a == "--schedule")
      args.only_schedule = next();
    else if (a == "--m")
      args.only_m = std::stoi(next());
    else {
      std::fprintf(stderr,
                   "usage: pipeline_bench [--json] [--width N] [--batch N] [--steps N] "
                   "[--schedule NAME] [--m M]\n");
      return 2;
    }
  }
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
