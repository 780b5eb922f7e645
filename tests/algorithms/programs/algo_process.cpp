// One rank of the process test: every algorithm's all_reduce, reduce_scatter
// and all_gather across real processes (started by cohortrun, gloo or MPI).
// Exits 0 when every result matches its formula, 1 with the first mismatch.
#include <cstdio>

#include "cohort/cohort.h"
#include "tests/contract/contract_values.h"

using namespace cohort;
using namespace cohort::testing;

int main() {
  try {
    auto comm = init();
    const int w = comm->size(), r = comm->rank();
    auto check = [&](bool ok, const std::string& what) {
      if (!ok) throw Error("mismatch: " + what);
    };
    for (auto algo : {Algorithm::Ring, Algorithm::Tree, Algorithm::HalvingDoubling,
                      Algorithm::Hierarchical, Algorithm::Engine, Algorithm::Adaptive}) {
      const std::string name = to_string(algo);
      for (auto dt : {torch::kFloat32, torch::kBFloat16, torch::kInt64}) {
        for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{(1 << 18) + 3}}) {
          // The large count (several pipeline segments) on f32 only.
          if (n > 1000 && dt != torch::kFloat32) continue;
          auto t = rank_input(r, n, dt);
          AllReduceOptions ao;
          ao.algo = algo;
          comm->all_reduce(t, ao).wait();
          check(matches(t, expected_reduction(ReduceOp::Sum, w, n)),
                name + " all_reduce " + dtype_label(dt) + " n " + std::to_string(n));

          std::vector<torch::Tensor> chunks;
          for (int j = 0; j < w; ++j) chunks.push_back(rank_input(r, n, dt) + j);
          auto out = torch::empty({n}, dt);
          ReduceScatterOptions ro;
          ro.algo = algo;
          comm->reduce_scatter_tensor(out, torch::cat(chunks), ro).wait();
          check(matches(out, expected_reduction(ReduceOp::Sum, w, n) + w * r),
                name + " reduce_scatter " + dtype_label(dt) + " n " + std::to_string(n));

          auto gathered = torch::empty({w * n}, dt);
          AllGatherOptions go;
          go.algo = algo;
          comm->all_gather_into_tensor(gathered, rank_input(r, n, dt), go).wait();
          for (int q = 0; q < w; ++q) {
            check(torch::equal(gathered.narrow(0, q * n, n), rank_input(q, n, dt)),
                  name + " all_gather " + dtype_label(dt) + " n " + std::to_string(n));
          }
        }
      }
    }
    if (r == 0) std::printf("algo_process: world %d backend %s ok\n", w, comm->backend().c_str());
    finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "algo_process: %s\n", e.what());
    return 1;
  }
}
