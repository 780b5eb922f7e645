// A program outside cohort's tree: one all-reduce and one DDP step through
// the umbrella header alone. Run it with `cohortrun -n 2 -- cohort_consumer`;
// it prints "consumer ok" on every rank whose results are right.
#ifdef USE_C10D_GLOO
#error "built with USE_C10D_GLOO: the test would not show that cohort's headers do without it"
#endif

#include <torch/nn/modules/linear.h>

#include <cstdio>
#include <cstring>

#include "cohort/cohort.h"

int main() {
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    const int n = comm->size();
    bool ok = std::strlen(COHORT_VERSION_STRING) > 0;

    // Every rank adds RANK+1: the sum is n(n+1)/2 everywhere.
    auto t = torch::full({3}, static_cast<float>(comm->rank() + 1));
    comm->all_reduce(t).wait();
    ok = ok && torch::all(t == n * (n + 1) / 2.0f).item<bool>();

    // DDP averages the gradients: the weight's gradient of sum(w * x), with
    // x = RANK+1 on each rank, is the mean of RANK+1, (n+1)/2.
    torch::manual_seed(0);
    torch::nn::Linear net(torch::nn::LinearOptions(1, 1).bias(false));
    cohort::DistributedDataParallel<torch::nn::Linear> ddp(net, comm);
    ddp.forward(torch::full({1, 1}, static_cast<float>(comm->rank() + 1))).sum().backward();
    ok = ok && net->weight.grad().item<float>() == (n + 1) / 2.0f;

    std::printf("consumer %s: rank %d of %d, cohort %s\n", ok ? "ok" : "WRONG", comm->rank(), n,
                COHORT_VERSION_STRING);
    cohort::finalize();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort_consumer: %s\n", e.what());
    return 1;
  }
}
