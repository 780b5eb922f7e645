// One rank of the process-based contract check, started by process_test with
// the torchrun environment. Modes:
//   contract   every collective once with formula-checked results; exit 0
//   dead-peer  rank 1 SIGKILLs itself after the first collective; the
//              survivors must get a named error within the timeout: exit 3
#include <signal.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>

#include "cohort/cohort.h"
#include "tests/contract/contract_values.h"

using namespace cohort;
using namespace cohort::testing;

namespace {

int failures = 0;

void check(bool ok, const std::string& what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "FAILED: %s\n", what.c_str());
  }
}

void contract(Communicator& comm) {
  const int w = comm.size(), me = comm.rank();
  for (auto dt : kDtypes) {
    for (auto op : ops_for(dt)) {
      for (int64_t n : {int64_t{7}, int64_t{1 << 18}}) {
        auto t = input_for(op, me, n, dt);
        comm.all_reduce(t, {op}).wait();
        check(matches(t, expected_reduction(op, w, n)),
              "all_reduce " + to_string(op) + " " + dtype_label(dt));
      }
    }
    auto in = rank_input(me, 5, dt);
    std::vector<torch::Tensor> outs(w);
    for (auto& o : outs) o = torch::empty({5}, dt);
    comm.all_gather(outs, in).wait();
    for (int r = 0; r < w; ++r) check(torch::equal(outs[r], rank_input(r, 5, dt)), "all_gather");
    auto b = rank_input(me, 9, dt);
    comm.broadcast(b, {w - 1}).wait();
    check(torch::equal(b, rank_input(w - 1, 9, dt)), "broadcast");
  }
  if (w > 1) {
    auto s = torch::full({100}, static_cast<double>(me), torch::kFloat64);
    auto r = torch::empty({100}, torch::kFloat64);
    auto sw = comm.send(s, (me + 1) % w, {11});
    comm.recv(r, (me + w - 1) % w, {11}).wait();
    sw.wait();
    check(r[0].item<double>() == (me + w - 1) % w, "send/recv ring");
  }
  comm.barrier().wait();
}

int dead_peer(Communicator& comm) {
  auto t = torch::ones({1 << 16});
  comm.all_reduce(t).wait();
  if (comm.rank() == 1) ::raise(SIGKILL);
  try {
    comm.all_reduce(t, {ReduceOp::Sum, std::chrono::seconds(5)}).wait();
  } catch (const PeerError& e) {
    std::fprintf(stderr, "survivor error: %s\n", e.what());
    return 3;
  } catch (const TimeoutError& e) {
    std::fprintf(stderr, "survivor error: %s\n", e.what());
    return 3;
  }
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "contract";
  torch::set_num_threads(1);
  try {
    auto comm = init();
    if (mode == "dead-peer") return dead_peer(*comm);
    contract(*comm);
    finalize();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "contract_process: %s\n", e.what());
    return 2;
  }
  std::printf("contract_process: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
