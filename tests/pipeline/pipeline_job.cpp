// The pipeline run as processes by cohortrun for the process equivalence
// test: on the small MLP of pipeline_test_models.h, each case (schedule, v,
// m) takes kSteps SGD steps over its own batches; every rank writes the
// per-step losses and its stages' parameters to DIR/<case>.rank<r>.txt, one
// "loss <step> <value>" or "param <index> <values...>" line each.
#include <torch/torch.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "cohort/cohort.h"
#include "cohort/pipeline/pipeline_runtime.h"
#include "pipeline_job_cases.h"
#include "pipeline_test_models.h"

namespace {

using namespace cohort::pipeline;
using namespace cohort::pipeline::testing;

void write_values(std::ofstream& out, const torch::Tensor& t) {
  auto flat = t.detach().to(torch::kFloat64).contiguous().view(-1);
  for (int64_t i = 0; i < flat.numel(); ++i) out << ' ' << flat[i].item<double>();
  out << '\n';
}

void run_case(const std::shared_ptr<cohort::Communicator>& comm, const JobCase& c,
              const std::string& dir) {
  const auto schedule = make_schedule(c.schedule, comm->size(), c.v, c.m);
  auto model = make_mlp(schedule.num_stages);
  std::vector<PipelineStage> mine;
  for (int s : schedule.stages_of(comm->rank()))
    mine.emplace_back(s, split_sequential(model, mlp_boundaries(schedule.num_stages), s));
  PipelineRuntime rt(cohort::DeviceMesh::from_group(comm, "pp"), std::move(mine), schedule, mse);
  torch::optim::SGD opt(rt.parameters(), torch::optim::SGDOptions(kJobLr));
  std::ofstream out(dir + "/" + c.name() + ".rank" + std::to_string(comm->rank()) + ".txt");
  out.precision(17);
  for (int step = 0; step < kJobSteps; ++step) {
    auto [x, y] = job_batch(c, step);
    opt.zero_grad();
    const auto r = rt.step({x}, {y});
    opt.step();
    out << "loss " << step << ' ' << r.loss << '\n';
  }
  const auto params = model->parameters();
  for (int s : schedule.stages_of(comm->rank())) {
    for (int k : {2 * s, 2 * s + 1}) {
      out << "param " << k;
      write_values(out, params[static_cast<size_t>(k)]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 || std::string(argv[1]) != "--out") {
    std::fprintf(stderr, "usage: pipeline_job --out DIR\n");
    return 2;
  }
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    for (const JobCase& c : job_cases()) run_case(comm, c, argv[2]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "pipeline_job: %s\n", e.what());
    return 1;
  }
  return 0;
}
