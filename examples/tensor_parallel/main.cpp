// Run: cohortrun -n 2 -- build/examples/tensor_parallel/tp_train --steps 20
//
// Tensor parallelism (Megatron-LM's MLP): the first Linear's output features
// and the second's input features are split over the mesh's "tp" dimension,
// so each rank holds 1/tp of both weights, and forward and backward need one
// all-reduce each. Every TP rank sees the same batch. After training, the
// model and AdamW state go to a distributed checkpoint under the unsplit
// model's names; every rank then reads the full weights back into a plain
// LibTorch MLP, whose output must match the sharded model's.
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "../common/train_args.h"
#include "cohort/cohort.h"

namespace {

namespace tp = cohort::tensor_parallel;

// Linear(16, 64) -> tanh -> Linear(64, 16) split over `mesh`'s "tp"
// dimension. The layers draw their full weights from their seeds and keep
// their slices: one model at every tp. The hidden width must divide by tp.
torch::nn::Sequential make_mlp(const cohort::DeviceMesh& mesh) {
  tp::ColumnParallelLinearOptions column;
  column.seed = 1;
  tp::RowParallelLinearOptions row;
  row.seed = 2;
  return torch::nn::Sequential(tp::ColumnParallelLinear(mesh["tp"], 16, 64, column),
                               torch::nn::Tanh(), tp::RowParallelLinear(mesh["tp"], 64, 16, row));
}

// The checkpoint in `dir` holds the whole model: load it into a plain
// LibTorch MLP and return how far its output on x is from `expected`.
double plain_mlp_error(const std::string& dir, const torch::Tensor& x,
                       const torch::Tensor& expected) {
  const auto meta = cohort::dcp::read_metadata(dir);
  torch::nn::Sequential plain(torch::nn::Linear(16, 64), torch::nn::Tanh(),
                              torch::nn::Linear(64, 16));
  torch::NoGradGuard no_grad;
  for (auto& item : plain->named_parameters()) {
    item.value().copy_(cohort::dcp::read_tensor(dir, meta, "model." + item.key()));
  }
  return (plain->forward(x) - expected).abs().max().item<double>();
}

int run(int steps, const std::string& dir) {
  torch::set_num_threads(1);
  auto world = cohort::init();
  auto mesh = cohort::init_device_mesh(world, {world->size()}, {"tp"});
  auto mlp = make_mlp(mesh);
  torch::optim::AdamW opt(mlp->parameters(), torch::optim::AdamWOptions(1e-2));

  torch::manual_seed(0);  // the same batch on every TP rank
  auto x = torch::randn({128, 16});
  auto y = torch::sin(x.matmul(torch::randn({16, 16})));
  double first = 0, last = 0;
  for (int step = 0; step < steps; ++step) {
    opt.zero_grad();
    auto loss = torch::mse_loss(mlp->forward(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }

  cohort::dcp::StateDictOptions tp_layout;
  tp_layout.mesh = &mesh;  // which tensors are split, and along which dimension
  cohort::dcp::save(cohort::dcp::get_state_dict(mlp, opt, tp_layout), dir, *mesh.process_group());

  torch::Tensor out;
  {
    torch::NoGradGuard no_grad;
    out = mlp->forward(x);  // collective over tp
  }
  const double diff = plain_mlp_error(dir, x, out);
  const bool ok = diff < 1e-5 && (steps < 2 || last < first);
  std::printf(
      "tp_train %s on rank %d of %d: loss %.4f -> %.4f, checkpoint as a plain MLP differs by "
      "%.2e\n",
      ok ? "ok" : "WRONG", mesh.rank(), mesh.size(), first, last, diff);
  cohort::finalize();
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  cohort_examples::TrainArgs args{20, "/tmp/cohort-tp-example"};
  if (auto code = cohort_examples::parse_train_args(
          argc, argv, "tp_train: a tensor-parallel MLP (cohortrun)", args))
    return *code;
  try {
    return run(args.steps, args.checkpoint_dir);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tp_train: %s\n", e.what());
    return 1;
  }
}
