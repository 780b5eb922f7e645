// Run: cohortrun -n 2 -- build/examples/ddp/ddp_train --steps 30
//  or, under Slurm: srun -n 2 build/examples/ddp/ddp_train --steps 30
//
// Data-parallel training with DistributedDataParallel: every rank holds a
// replica of the model and trains on its own shard of the data; backward
// averages the gradients across ranks, so every replica takes the same step.
// At the end the model and optimizer go to a distributed checkpoint, which
// any other mode and world size can load (cohort/dcp/state_dict/state_dict.h).
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "../common/train_args.h"
#include "cohort/cohort.h"

int main(int argc, char** argv) {
  cohort_examples::TrainArgs args{30, "/tmp/cohort-ddp-example"};
  if (auto code = cohort_examples::parse_train_args(
          argc, argv, "ddp_train: data-parallel training with DistributedDataParallel (cohortrun)",
          args))
    return *code;
  try {
    torch::set_num_threads(1);
    auto world = cohort::init();
    // One dimension of replicas: DDP takes the mesh, data and checkpoints its group.
    auto mesh = cohort::init_device_mesh(world, {world->size()}, {"dp"});
    const auto& comm = mesh.process_group();
    const int rank = comm->rank();

    // The same data on every rank (seed 0, alike); each rank trains on the
    // rows r, r + n, r + 2n, ... that DistributedSampler deals it (with a
    // torch::data dataset, the sampler goes to make_data_loader instead).
    cohort::data::manual_seed(0, cohort::data::SeedScope::Same, *comm);
    auto x = torch::randn({256, 8});
    auto y = x.matmul(torch::randn({8, 1}));
    cohort::data::DistributedSamplerOptions deal;
    deal.shuffle = false;
    const auto rows = cohort::data::DistributedSampler(256, *comm, deal).indices();
    auto shard = torch::tensor(std::vector<int64_t>(rows.begin(), rows.end()));
    auto xs = x.index_select(0, shard), ys = y.index_select(0, shard);

    // DDP broadcasts rank 0's initial weights, so replicas start equal.
    // Seeded per rank on purpose: DDP fixes it.
    cohort::data::manual_seed(0, cohort::data::SeedScope::PerRank, *comm);
    torch::nn::Sequential net(torch::nn::Linear(8, 16), torch::nn::Tanh(),
                              torch::nn::Linear(16, 1));
    cohort::DistributedDataParallel<torch::nn::Sequential> ddp(net, mesh);
    torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.05));

    double first = 0, last = 0;
    for (int step = 0; step < args.steps; ++step) {
      opt.zero_grad();
      // Gradient accumulation: the first half-batch's backward runs under
      // no_sync() (local only); the second one all-reduces the sum.
      const auto half = xs.size(0) / 2;
      {
        auto guard = ddp->no_sync();
        torch::mse_loss(ddp->forward(xs.slice(0, 0, half)), ys.slice(0, 0, half)).backward();
      }
      auto loss = torch::mse_loss(ddp->forward(xs.slice(0, half)), ys.slice(0, half));
      loss.backward();
      opt.step();
      (step == 0 ? first : last) = loss.item<double>();
    }

    // The replicas stayed identical: max - min of every weight across ranks is 0.
    auto flat = torch::cat({net[0]->parameters()[0].flatten(), net[2]->parameters()[0].flatten()});
    auto hi = flat.clone(), lo = flat.clone();
    cohort::AllReduceOptions max_op, min_op;
    max_op.op = cohort::ReduceOp::Max;
    min_op.op = cohort::ReduceOp::Min;
    comm->all_reduce(hi, max_op).wait();
    comm->all_reduce(lo, min_op).wait();
    // Every rank saves its view; a replicated tensor is written once.
    cohort::dcp::save(cohort::dcp::get_state_dict(ddp, opt), args.checkpoint_dir, *comm);
    const bool ok = torch::equal(hi, lo) && (args.steps < 2 || last < first);
    std::printf("ddp_train %s on rank %d of %d: loss %.4f -> %.4f, replicas identical: %s\n",
                ok ? "ok" : "WRONG", rank, comm->size(), first, last,
                torch::equal(hi, lo) ? "yes" : "no");
    cohort::finalize();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_train: %s\n", e.what());
    return 1;
  }
}
