// sequence_mean_loss: one all-reduce of the rank's loss sum, its count and
// a flag per rank for arguments that do not fit.
#include "cohort/context_parallel/sequence_loss.h"

#include <string>

#include "cohort/core/error.h"

namespace cohort::context_parallel {

namespace {

std::string shape(const torch::Tensor& t) {
  std::string out;
  for (auto n : t.sizes()) out += (out.empty() ? "" : ", ") + std::to_string(n);
  return "[" + out + "] " + std::string(c10::toString(t.scalar_type()));
}

}  // namespace

torch::Tensor sequence_mean_loss(const torch::Tensor& token_losses, const torch::Tensor& counted,
                                 Communicator& g) {
  const int cp = g.size();
  const std::string who = "cohort: sequence_mean_loss on rank " + std::to_string(g.rank()) +
                          " of " + std::to_string(cp) + ": ";
  const bool fits = token_losses.defined() && counted.defined() &&
                    token_losses.is_floating_point() && counted.scalar_type() == torch::kBool &&
                    counted.sizes() == token_losses.sizes();
  // Ignored tokens usually carry a zero loss already; masking makes sure.
  auto local = fits ? token_losses.masked_fill(counted.logical_not(), 0).sum()
                    : torch::zeros({}, torch::kFloat32);
  // Every rank joins the all-reduce, fitting or not, so none waits for a
  // rank that threw; the flags tell every rank which ranks did not fit.
  auto stats = torch::zeros({2 + cp}, torch::kFloat64);
  auto* s = stats.data_ptr<double>();
  if (fits) {
    s[0] = local.detach().item<double>();
    s[1] = static_cast<double>(counted.sum().item<int64_t>());
  } else {
    s[2 + g.rank()] = 1;
  }
  g.all_reduce(stats, {ReduceOp::Sum}).wait();
  std::string bad;
  for (int r = 0; r < cp; ++r) {
    if (s[2 + r] != 0) bad += (bad.empty() ? "" : ", ") + std::to_string(r);
  }
  if (!bad.empty()) {
    throw InvalidArgument(
        who + "rank(s) " + bad +
        " passed token losses that are not floating point or a counted mask that is not bool of "
        "their shape" +
        (fits ? ""
              : " (this rank: " + (token_losses.defined() ? shape(token_losses) : "undefined") +
                    " and " + (counted.defined() ? shape(counted) : "undefined") + ")"));
  }
  // The value is the sequence's mean on every rank. The second term is zero
  // in value; its gradient gives this rank's tokens cp / N, which the
  // average over the cp ranks' gradients turns into 1 / N.
  const double n = s[1];
  auto scaled = local * static_cast<double>(cp);
  auto mean = torch::full({}, s[0] / n, local.options());
  return mean + (scaled - scaled.detach()) / n;
}

}  // namespace cohort::context_parallel
