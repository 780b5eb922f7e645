// Run: cohortrun -n 2 -- build/examples/communicator/communicator_basics
//
// The Communicator's basics: rendezvous from the launcher's environment,
// collectives that return a Work to wait on, point-to-point messages and
// subgroups. Each rank checks what it received against a closed formula.
#include <torch/torch.h>

#include <cstdio>

#include "cohort/cohort.h"

int main() {
  try {
    torch::set_num_threads(1);
    // RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT come from cohortrun.
    auto comm = cohort::init();
    const int rank = comm->rank(), n = comm->size();
    bool ok = true;

    // all_reduce is asynchronous: it returns a Work; wait() rethrows the
    // operation's error (naming the rank and the peer) or returns when done.
    auto x = torch::full({4}, rank + 1.0f);
    cohort::AllReduceOptions avg;
    avg.op = cohort::ReduceOp::Avg;
    comm->all_reduce(x, avg).wait();
    ok &= torch::allclose(x, torch::full({4}, (n + 1) / 2.0f));

    // broadcast: rank 0's tensor everywhere.
    auto seed = torch::tensor({rank == 0 ? 1234 : -1}, torch::kInt64);
    comm->broadcast(seed).wait();
    ok &= seed.item<int64_t>() == 1234;

    // all_gather: one output tensor per rank, in rank order.
    std::vector<torch::Tensor> gathered(n);
    for (auto& t : gathered) t = torch::empty({2});
    comm->all_gather(gathered, torch::full({2}, static_cast<float>(rank))).wait();
    for (int r = 0; r < n; ++r) ok &= gathered[r][0].item<float>() == r;

    // send/recv around a ring: each rank receives its left neighbour's rank.
    if (n > 1) {
      auto out = torch::tensor({static_cast<float>(rank)});
      auto in = torch::empty({1});
      auto sent = comm->send(out, (rank + 1) % n);
      comm->recv(in, (rank + n - 1) % n).wait();
      sent.wait();
      ok &= in.item<float>() == (rank + n - 1) % n;
    }

    // split(color, key): a communicator per color, ranked by key; here the
    // even and the odd ranks, each summing its members' ranks.
    auto group = comm->split(rank % 2, rank);
    auto s = torch::tensor({static_cast<float>(rank)});
    group->all_reduce(s).wait();
    float expected = 0;
    for (int r = rank % 2; r < n; r += 2) expected += r;
    ok &= s.item<float>() == expected;

    std::printf("communicator_basics %s on rank %d of %d (%s)\n", ok ? "ok" : "WRONG", rank, n,
                comm->backend().c_str());
    comm->barrier().wait();
    cohort::finalize();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "communicator_basics: %s\n", e.what());
    return 1;
  }
}
