// Run: cohortrun -n 3 -- build/tests/data/seed_job
//
// seed_test's job: seeds LibTorch with cohort::data::manual_seed under each
// scope and prints, per rank, what LibTorch then draws (hex floats, exact):
//   rank R same   <randn(4)>
//   rank R perrank <randn(4)> mask <dropout of 16 ones>
#include <torch/torch.h>

#include <cstdio>
#include <string>

#include "cohort/cohort.h"

namespace {

std::string hex(const torch::Tensor& t) {
  std::string out;
  auto c = t.contiguous();
  for (int64_t i = 0; i < c.numel(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), " %a", static_cast<double>(c[i].item<float>()));
    out += buf;
  }
  return out;
}

}  // namespace

int main() {
  try {
    torch::set_num_threads(1);
    auto comm = cohort::init();
    const int rank = comm->rank();
    cohort::data::manual_seed(42, cohort::data::SeedScope::Same, *comm);
    const auto same = torch::randn({4});
    cohort::data::manual_seed(42, cohort::data::SeedScope::PerRank, *comm);
    const auto noise = torch::randn({4});
    const auto mask = torch::dropout(torch::ones({16}), 0.5, /*train=*/true);
    std::printf("rank %d same%s\nrank %d perrank%s mask%s\n", rank, hex(same).c_str(), rank,
                hex(noise).c_str(), hex(mask).c_str());
    cohort::finalize();
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "seed_job: %s\n", e.what());
    return 1;
  }
}
