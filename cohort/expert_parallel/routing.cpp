#include "cohort/expert_parallel/routing.h"

#include <algorithm>
#include <cmath>

namespace cohort::expert_parallel {

int64_t expert_capacity(double capacity_factor, int64_t tokens, int64_t k, int64_t experts) {
  // Megatron-Core's get_capacity, operation for operation, in doubles:
  // ceil((T * k / E) * factor). The order decides where the product lands
  // within an ulp of an integer: (90 / 3) * 1.1 is 33.0 but 1.1 * 90 / 3 is
  // 33.00000000000001, whose ceil is 34; the same routing must keep the
  // same tokens as the reference.
  const int64_t most = tokens * k;
  const double slots = static_cast<double>(most) / static_cast<double>(experts) * capacity_factor;
  // No expert can be asked for more than T * k slots; capping there keeps a
  // huge factor (meaning "drop nothing") from overflowing the cast, and
  // keeps the same assignments.
  if (!(slots < static_cast<double>(most))) return most;
  return static_cast<int64_t>(std::ceil(slots));
}

Routing route(const torch::Tensor& logits, int64_t k, double capacity_factor) {
  const int64_t tokens = logits.size(0), experts = logits.size(1);
  Routing r;
  r.probs = torch::softmax(logits, -1);
  auto [values, indices] = r.probs.topk(k, -1);
  auto gates = k == 1 ? values : values / values.sum(-1, /*keepdim=*/true);
  // Choice-major: all first choices, then all second choices.
  r.expert = indices.t().reshape({-1});
  r.gate = gates.t().reshape({-1});
  r.token = torch::arange(tokens, logits.options().dtype(torch::kInt64)).repeat({k});
  r.capacity = expert_capacity(capacity_factor, tokens, k, experts);
  // Each assignment's place in its expert's queue: the running count of
  // earlier assignments to the same expert.
  auto onehot = torch::one_hot(r.expert, experts);
  auto place = (onehot.cumsum(0) - 1).gather(1, r.expert.unsqueeze(1)).squeeze(1);
  r.kept = place < r.capacity;
  return r;
}

torch::Tensor load_balancing_loss(const Routing& routing) {
  const int64_t tokens = routing.probs.size(0), experts = routing.probs.size(1);
  if (tokens == 0) return routing.probs.sum() * 0;
  auto f = torch::bincount(routing.expert, {}, experts).to(routing.probs.scalar_type()) /
           static_cast<double>(routing.expert.numel());
  auto p = routing.probs.mean(0);
  return (f * p).sum() * static_cast<double>(experts);
}

torch::Tensor load_balancing_loss(const Routing& routing, Communicator& g) {
  std::vector<int64_t> words;
  return load_balancing_loss(routing, g, {}, words);
}

torch::Tensor load_balancing_loss(const Routing& routing, Communicator& g,
                                  const std::vector<int64_t>& mine, std::vector<int64_t>& all) {
  const int64_t experts = routing.probs.size(1), n = g.size();
  const auto w = static_cast<int64_t>(mine.size());
  // Per expert: assignments, then summed probabilities; then the tokens and
  // the assignments, all summed over the group; then each rank's words
  // (zero but its own), exact in a double.
  auto stats = torch::zeros({2 * experts + 2 + n * w}, torch::kFloat64);
  stats.narrow(0, 0, experts).copy_(torch::bincount(routing.expert, {}, experts).cpu());
  stats.narrow(0, experts, experts).copy_(routing.probs.detach().sum(0).cpu());
  stats[2 * experts] = static_cast<double>(routing.probs.size(0));
  stats[2 * experts + 1] = static_cast<double>(routing.expert.numel());
  for (int64_t i = 0; i < w; ++i) {
    stats[2 * experts + 2 + g.rank() * w + i] = static_cast<double>(mine[static_cast<size_t>(i)]);
  }
  g.all_reduce(stats, {ReduceOp::Sum}).wait();
  const auto got = stats.narrow(0, 2 * experts + 2, n * w);
  const double* words = got.data_ptr<double>();
  all.assign(static_cast<size_t>(n * w), 0);
  for (int64_t i = 0; i < n * w; ++i) all[static_cast<size_t>(i)] = static_cast<int64_t>(words[i]);
  const double tokens = stats[2 * experts].item<double>();
  const double assignments = stats[2 * experts + 1].item<double>();
  if (tokens == 0) return routing.probs.sum() * 0;
  auto f = stats.narrow(0, 0, experts) / assignments;
  const double whole =
      (f * stats.narrow(0, experts, experts)).sum().item<double>() * experts / tokens;
  // This rank's share, in the graph; zero in value.
  auto share = (routing.probs.sum(0) * f.to(routing.probs.options())).sum() *
               (static_cast<double>(experts) * g.size() / tokens);
  return torch::full({}, whole, routing.probs.options()) + (share - share.detach());
}

}  // namespace cohort::expert_parallel
