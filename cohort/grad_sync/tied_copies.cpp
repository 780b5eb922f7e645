#include "cohort/grad_sync/tied_copies.h"

#include <string>

#include "cohort/comm/communicator.h"
#include "cohort/core/agreement.h"
#include "cohort/core/error.h"
#include "cohort/grad_sync/average_gradients.h"

namespace cohort {
namespace {

constexpr int kShownDims = 8;

// What a rank holds, as words: copies, a local fault (1: undefined copy, 2:
// its copies differ), dtype, dim, a digest of the sizes, the first sizes,
// its order.
std::vector<int64_t> describe(const std::vector<torch::Tensor>& copies, int64_t order) {
  std::vector<int64_t> words(6 + kShownDims, 0);
  words[0] = static_cast<int64_t>(copies.size());
  words[5 + kShownDims] = order;
  if (copies.empty()) return words;
  for (const auto& c : copies) {
    if (!c.defined()) {
      words[1] = 1;
      return words;
    }
  }
  const auto& first = copies[0];
  for (const auto& c : copies) {
    if (c.sizes() != first.sizes() || c.scalar_type() != first.scalar_type()) words[1] = 2;
  }
  const auto sizes = first.sizes().vec();
  words[2] = static_cast<int64_t>(first.scalar_type());
  words[3] = first.dim();
  words[4] = static_cast<int64_t>(fnv1a_words(sizes));
  for (int d = 0; d < std::min<int>(first.dim(), kShownDims); ++d) words[5 + d] = sizes[d];
  return words;
}

std::string shape_text(const int64_t* w) {
  std::string text = "[";
  for (int d = 0; d < std::min<int64_t>(w[3], kShownDims); ++d)
    text += (d ? ", " : "") + std::to_string(w[5 + d]);
  if (w[3] > kShownDims) text += ", ...";
  return text + "] " + std::string(c10::toString(static_cast<c10::ScalarType>(w[2])));
}

// Why the ranks' copies cannot be one weight, or "".
std::string mismatch(const RankWords& all, const std::string& name) {
  int first = -1;
  for (int r = 0; r < all.ranks(); ++r) {
    const int64_t* w = all.of(r);
    if (w[0] == 0) continue;
    if (w[1] == 1)
      return "rank " + std::to_string(r) + " passed an undefined copy of '" + name + "'";
    if (w[1] == 2)
      return "rank " + std::to_string(r) + " holds copies of '" + name +
             "' of different shapes or dtypes";
    if (first < 0) {
      first = r;
      continue;
    }
    const int64_t* f = all.of(first);
    if (w[2] != f[2] || w[3] != f[3] || w[4] != f[4])
      return "the copies of '" + name + "' differ: " + shape_text(f) + " on rank " +
             std::to_string(first) + ", " + shape_text(w) + " on rank " + std::to_string(r);
  }
  return "";
}

}  // namespace

TiedCopies::TiedCopies(Communicator& group, std::vector<torch::Tensor> copies,
                       const std::string& name, const std::string& who, int64_t order)
    : copies_(std::move(copies)) {
  // Every rank learns what every other holds, so a bad copy is an error on
  // all of them (a rank without the weight would otherwise wait for the
  // others' first activations until its timeout).
  const RankWords all = gather_words(group, describe(copies_, order < 0 ? group.rank() : order));
  const std::string error = mismatch(all, name);
  if (!error.empty()) {
    throw InvalidArgument(who + "tied weight '" + name + "': " + error + " (group " + group.name() +
                          ")");
  }
  // The split orders the holders by their rank in `group`: the original's
  // rank in it is the number of holders below it.
  int root = 0;
  for (int r = 0; r < all.ranks(); ++r) {
    if (all.of(r)[0] == 0) continue;
    const int64_t o = all.of(r)[5 + kShownDims];
    if (original_rank_ < 0 || o < all.of(original_rank_)[5 + kShownDims]) original_rank_ = r;
  }
  for (int r = 0; r < original_rank_; ++r) root += all.of(r)[0] > 0;
  original_here_ = original_rank_ == group.rank();
  group_ = group.split(copies_.empty() ? -1 : 0, group.rank());
  if (copies_.empty()) return;
  torch::NoGradGuard no_grad;
  if (group_->size() > 1) {
    auto value = copies_[0].detach().contiguous();
    group_->broadcast(value, {root}).wait();
    copies_[0].detach().copy_(value);
  }
  for (size_t i = 1; i < copies_.size(); ++i) copies_[i].detach().copy_(copies_[0].detach());
}

TiedCopies::~TiedCopies() = default;

std::vector<torch::Tensor> TiedCopies::duplicates() const {
  if (copies_.empty()) return {};
  return {copies_.begin() + (original_here_ ? 1 : 0), copies_.end()};
}

int64_t TiedCopies::sum_gradients(const AllReduceOptions& options) {
  if (copies_.empty()) return 0;
  torch::NoGradGuard no_grad;
  torch::Tensor first = copies_[0];
  auto has = [](const torch::Tensor& t) { return t.requires_grad() && t.grad().defined(); };
  // This rank's copies into the first (which may have none yet).
  for (size_t i = 1; i < copies_.size(); ++i) {
    if (!has(copies_[i])) continue;
    if (first.grad().defined()) {
      first.mutable_grad().add_(copies_[i].grad());
    } else {
      first.mutable_grad() = copies_[i].grad().detach().clone();
    }
  }
  const int64_t bytes = reduce_gradients({first}, *group_, options);
  if (!first.grad().defined()) return bytes;
  for (size_t i = 1; i < copies_.size(); ++i) {
    if (!copies_[i].requires_grad()) continue;
    if (copies_[i].grad().defined()) {
      copies_[i].mutable_grad().copy_(first.grad());
    } else {
      copies_[i].mutable_grad() = first.grad().clone();
    }
  }
  return bytes;
}

}  // namespace cohort
