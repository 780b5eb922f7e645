// canonical_squared_norm: block sums over the global flat index, the
// straddling blocks completed from the next ranks' leading fragments.
#include "cohort/grad_sync/canonical_norm.h"

#include <algorithm>
#include <vector>

#include "cohort/comm/communicator.h"
#include "cohort/core/error.h"

namespace cohort {
namespace {

double block_sum(const torch::Tensor& block) {
  // A fresh float64 copy: the same contiguous bits whatever the slice's
  // offset in memory; the squares of float32 values are exact in float64.
  return block.to(torch::kFloat64).square().sum().item<double>();
}

}  // namespace

double canonical_squared_norm(Communicator* comm, const torch::Tensor& slice_in, int64_t offset,
                              int64_t total) {
  torch::NoGradGuard no_grad;
  const auto slice = slice_in.detach().reshape({-1});
  const int64_t len = slice.numel();
  const int64_t end = offset + len;
  const int64_t B = kCanonicalNormBlock;
  const int world = comm ? comm->size() : 1;
  if (offset < 0 || end > total || (!comm && (offset != 0 || len != total))) {
    throw InvalidArgument("canonical_squared_norm: slice [" + std::to_string(offset) + ", " +
                          std::to_string(end) + ") does not fit a vector of " +
                          std::to_string(total) + " elements" +
                          (comm ? " on rank " + std::to_string(comm->rank()) : std::string()));
  }
  // The leading fragment: up to the first block boundary at or after offset.
  const int64_t first_start = std::min((offset + B - 1) / B * B, end);
  const int64_t head = first_start - offset;
  // Every rank's offset, slice length and head, then the heads themselves.
  std::vector<int64_t> offsets{offset}, lens{len}, heads{head};
  torch::Tensor all_heads = slice.narrow(0, 0, head);
  if (world > 1) {
    auto mine = torch::tensor({offset, len, head}, torch::kLong);
    auto all = torch::empty({world * 3}, torch::kLong);
    comm->all_gather_into_tensor(all, mine).wait();
    offsets.clear();
    lens.clear();
    heads.clear();
    for (int r = 0; r < world; ++r) {
      offsets.push_back(all[r * 3].item<int64_t>());
      lens.push_back(all[r * 3 + 1].item<int64_t>());
      heads.push_back(all[r * 3 + 2].item<int64_t>());
    }
    auto padded = torch::zeros({B}, slice.options());
    padded.narrow(0, 0, head).copy_(slice.narrow(0, 0, head));
    all_heads = torch::empty({world * B}, slice.options());
    comm->all_gather_into_tensor(all_heads, padded).wait();
  }
  const int rank = comm ? comm->rank() : 0;
  // The blocks that start in this slice, each summed whole.
  std::vector<double> sums;
  for (int64_t s = first_start; s < end; s += B) {
    const int64_t e = std::min(s + B, total);
    if (e <= end) {
      sums.push_back(block_sum(slice.narrow(0, s - offset, e - s)));
      continue;
    }
    std::vector<torch::Tensor> parts{slice.narrow(0, s - offset, end - s)};
    int64_t at = end;
    for (int q = rank + 1; q < world && at < e; ++q) {
      if (lens[q] == 0) continue;
      COHORT_CHECK(offsets[q] == at, "canonical_squared_norm: the ranks' slices do not tile");
      parts.push_back(all_heads.narrow(0, int64_t{q} * B, heads[q]));
      at += heads[q];
    }
    COHORT_CHECK(at == e, "canonical_squared_norm: a block's end is on no rank");
    sums.push_back(block_sum(torch::cat(parts)));
  }
  // Every block's sum on every rank, then the sum in block order.
  std::vector<double> ordered = sums;
  if (world > 1) {
    const int64_t most = (total + B - 1) / B;
    auto mine = torch::zeros({most + 1}, torch::kFloat64);
    mine[0] = static_cast<double>(sums.size());
    for (size_t i = 0; i < sums.size(); ++i) mine[static_cast<int64_t>(i) + 1] = sums[i];
    auto all = torch::empty({world * (most + 1)}, torch::kFloat64);
    comm->all_gather_into_tensor(all, mine).wait();
    ordered.clear();
    auto a = all.accessor<double, 1>();
    for (int r = 0; r < world; ++r) {
      const int64_t base = int64_t{r} * (most + 1);
      const auto count = static_cast<int64_t>(a[base]);
      for (int64_t i = 0; i < count; ++i) ordered.push_back(a[base + 1 + i]);
    }
  }
  double sum = 0.0;
  for (double v : ordered) sum += v;
  return sum;
}

}  // namespace cohort
