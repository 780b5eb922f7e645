// Run: cohortrun -n 2 -- build/examples/zero/zero_train --steps 20
//
// ZeRO (stage 2) under DDP: each rank keeps the AdamW state and the averaged
// gradients of only its 1/N of the parameters. Backward reduce-scatters the
// gradients into the shards (instead of DDP's all-reduce), each rank updates
// its shard, and the updated parameters are all-gathered. The arithmetic is
// that of DDP + AdamW, with 1/N of the optimizer's memory per rank. At the
// end each rank saves its pieces of the AdamW state into one distributed
// checkpoint, which loads into any other mode and world size.
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "../common/train_args.h"
#include "cohort/cohort.h"

int main(int argc, char** argv) {
  cohort_examples::TrainArgs args{20, "/tmp/cohort-zero-example"};
  if (auto code = cohort_examples::parse_train_args(
          argc, argv, "zero_train: ZeRO stage 2 under DDP (cohortrun)", args))
    return *code;
  try {
    torch::set_num_threads(1);
    auto world = cohort::init();
    auto mesh = cohort::init_device_mesh(world, {world->size()}, {"dp"});
    const int rank = mesh.rank(), n = mesh.size();

    torch::manual_seed(0);
    auto x = torch::randn({128, 32});
    auto y = x.matmul(torch::randn({32, 4}));
    auto shard = torch::arange(rank, 128, n);
    auto xs = x.index_select(0, shard), ys = y.index_select(0, shard);

    torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(),
                              torch::nn::Linear(64, 4));
    cohort::DistributedDataParallel<torch::nn::Sequential> ddp(net, mesh);
    // The options of a C++17 aggregate are set field by field.
    cohort::ZeroOptions zero_options;
    zero_options.stage = 2;
    zero_options.bucket_cap_mb = 1;
    // make(ddp, ...) makes ZeRO the owner of DDP's gradient reduction.
    auto zero = cohort::ZeroRedundancyOptimizer::make<torch::optim::AdamW>(
        ddp, torch::optim::AdamWOptions(1e-2), zero_options);

    double first = 0, last = 0;
    for (int step = 0; step < args.steps; ++step) {
      zero->zero_grad();
      auto loss = torch::mse_loss(ddp->forward(xs), ys);
      loss.backward();  // reduce-scatters buckets into the shards as they fill
      zero->step();     // updates this rank's shard, all-gathers the parameters
      (step == 0 ? first : last) = loss.item<double>();
    }

    // AdamW keeps two tensors per parameter element (exp_avg, exp_avg_sq);
    // this rank holds them for its shard only.
    int64_t param_bytes = 0;
    for (const auto& p : net->parameters()) param_bytes += p.numel() * p.element_size();
    const double share = zero->state_bytes() / (2.0 * param_bytes);
    cohort::dcp::save(cohort::dcp::get_state_dict(ddp, *zero), args.checkpoint_dir,
                      *mesh.process_group());
    const bool ok = (args.steps < 2 || last < first) && share < 1.0 / n + 0.05;
    std::printf("zero_train %s on rank %d: loss %.4f -> %.4f, optimizer state %.2f of AdamW's\n",
                ok ? "ok" : "WRONG", rank, first, last, share);
    cohort::finalize();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "zero_train: %s\n", e.what());
    return 1;
  }
}
