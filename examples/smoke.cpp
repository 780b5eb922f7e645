// The smoke job: every rank contributes RANK+1; the all-reduced sum must be
// n(n+1)/2 on every rank. Run it with `cohortrun -n 2 -- cohort_smoke`.
#include <cstdio>

#include "cohort/cohort.h"

int main() {
  try {
    auto comm = cohort::init();
    const int n = comm->size();
    auto t = torch::full({4}, static_cast<float>(comm->rank() + 1));
    comm->all_reduce(t).wait();
    const float expected = n * (n + 1) / 2.0f;
    const bool ok = torch::all(t == expected).item<bool>();
    std::printf("all_reduce %s: rank %d of %d got %.1f, expected %.1f (backend %s)\n",
                ok ? "ok" : "WRONG", comm->rank(), n, t[0].item<float>(), expected,
                comm->backend().c_str());
    comm->barrier().wait();
    cohort::finalize();
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cohort_smoke: %s\n", e.what());
    return 1;
  }
}
