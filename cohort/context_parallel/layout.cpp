// The zig-zag layout's arithmetic and the shard/unshard helpers. Everything
// here is local except gather_sequence.
#include "cohort/context_parallel/layout.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <string>

#include "cohort/core/error.h"

namespace cohort::context_parallel {

ZigZagLayout::ZigZagLayout(int64_t length, int cp) : length_(length), cp_(cp) {
  if (cp < 1) throw InvalidArgument("cohort: ZigZagLayout: cp = " + std::to_string(cp) + " < 1");
  if (length < 2 * static_cast<int64_t>(cp)) {
    throw InvalidArgument("cohort: ZigZagLayout: a sequence of " + std::to_string(length) +
                          " positions is shorter than its 2·cp = " + std::to_string(2 * cp) +
                          " chunks (each chunk needs at least one position)");
  }
}

int64_t ZigZagLayout::chunk_length(int c) const {
  const int64_t n = chunks();
  return length_ / n + (c < length_ % n ? 1 : 0);
}

int64_t ZigZagLayout::chunk_start(int c) const {
  const int64_t n = chunks();
  return c * (length_ / n) + std::min<int64_t>(c, length_ % n);
}

int64_t ZigZagLayout::local_length(int rank) const {
  const auto c = chunks_of(rank);
  return chunk_length(c[0]) + chunk_length(c[1]);
}

torch::Tensor ZigZagLayout::positions(int rank) const {
  const auto c = chunks_of(rank);
  auto first = torch::arange(chunk_start(c[0]), chunk_start(c[0]) + chunk_length(c[0]));
  auto second = torch::arange(chunk_start(c[1]), chunk_start(c[1]) + chunk_length(c[1]));
  return torch::cat({first, second});
}

namespace {

int64_t checked_dim(const torch::Tensor& t, int64_t dim, const char* who) {
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  if (d < 0 || d >= t.dim()) {
    throw InvalidArgument(std::string("cohort: ") + who + ": dim " + std::to_string(dim) +
                          " is outside a tensor of " + std::to_string(t.dim()) + " dimensions");
  }
  return d;
}

}  // namespace

torch::Tensor shard_sequence(const torch::Tensor& full, int rank, int cp, int64_t dim) {
  const int64_t d = checked_dim(full, dim, "shard_sequence");
  const ZigZagLayout layout(full.size(d), cp);
  if (rank < 0 || rank >= cp) {
    throw InvalidArgument("cohort: shard_sequence: rank " + std::to_string(rank) +
                          " is outside [0, " + std::to_string(cp) + ")");
  }
  const auto c = layout.chunks_of(rank);
  return torch::cat({full.narrow(d, layout.chunk_start(c[0]), layout.chunk_length(c[0])),
                     full.narrow(d, layout.chunk_start(c[1]), layout.chunk_length(c[1]))},
                    d);
}

torch::Tensor unshard_sequence(const std::vector<torch::Tensor>& shards, int64_t dim) {
  if (shards.empty()) throw InvalidArgument("cohort: unshard_sequence: no shards");
  const int cp = static_cast<int>(shards.size());
  const int64_t d = checked_dim(shards[0], dim, "unshard_sequence");
  int64_t length = 0;
  for (const auto& s : shards) length += s.size(d);
  const ZigZagLayout layout(length, cp);
  // Chunk c comes from the rank that holds it: rank c (its early chunk) or
  // rank 2cp-1-c (its late one).
  std::vector<torch::Tensor> pieces(static_cast<size_t>(layout.chunks()));
  for (int r = 0; r < cp; ++r) {
    const auto& s = shards[static_cast<size_t>(r)];
    if (s.size(d) != layout.local_length(r)) {
      throw InvalidArgument("cohort: unshard_sequence: rank " + std::to_string(r) +
                            "'s shard has " + std::to_string(s.size(d)) +
                            " positions; the zig-zag layout of " + std::to_string(length) +
                            " over cp = " + std::to_string(cp) + " gives it " +
                            std::to_string(layout.local_length(r)));
    }
    const auto c = layout.chunks_of(r);
    const int64_t early = layout.chunk_length(c[0]);
    pieces[static_cast<size_t>(c[0])] = s.narrow(d, 0, early);
    pieces[static_cast<size_t>(c[1])] = s.narrow(d, early, s.size(d) - early);
  }
  return torch::cat(pieces, d);
}

torch::Tensor gather_sequence(const torch::Tensor& local, Communicator& group, int64_t dim) {
  const int64_t d = checked_dim(local, dim, "gather_sequence");
  const int cp = group.size();
  // Not differentiable (the copy into the padded block detaches): a shard
  // that requires grad under grad mode is refused, its length sent as -1 in
  // the lengths' all-gather so that every rank throws.
  const bool refused = c10::GradMode::is_enabled() && local.requires_grad();
  auto mine = torch::full({1}, refused ? -1 : local.size(d), torch::kInt64);
  auto lengths = torch::empty({cp}, torch::kInt64);
  group.all_gather_into_tensor(lengths, mine).wait();
  for (int r = 0; r < cp; ++r) {
    if (lengths[r].item<int64_t>() >= 0) continue;
    throw InvalidArgument("cohort: gather_sequence (rank " + std::to_string(group.rank()) + " of " +
                          std::to_string(cp) + ", group " + group.name() + "): rank " +
                          std::to_string(r) +
                          "'s shard requires grad, and gather_sequence is not differentiable "
                          "(a loss built on it would get no gradient through it): it is for "
                          "evaluation and logging; call it under torch::NoGradGuard or on "
                          "detached tensors");
  }
  // Shards may differ by a position (uneven chunks): pad to the longest so
  // one all-gather of equal blocks carries them.
  const int64_t longest = lengths.max().item<int64_t>();
  auto sizes = local.sizes().vec();
  sizes[static_cast<size_t>(d)] = longest;
  auto padded = torch::zeros(sizes, local.options());
  padded.narrow(d, 0, local.size(d)).copy_(local.detach());
  auto moved = padded.movedim(d, 0).contiguous();
  auto all_sizes = moved.sizes().vec();
  all_sizes[0] *= cp;
  auto all = torch::empty(all_sizes, local.options());
  group.all_gather_into_tensor(all, moved).wait();
  std::vector<torch::Tensor> shards;
  for (int r = 0; r < cp; ++r) {
    shards.push_back(all.narrow(0, r * longest, lengths[r].item<int64_t>()).movedim(0, d));
  }
  return unshard_sequence(shards, d);
}

}  // namespace cohort::context_parallel
