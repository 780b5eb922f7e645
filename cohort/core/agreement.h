// defines: cross-rank agreement, the one way a module checks that every rank
// passed the same thing (a mesh shape, a schedule, a model's parameters, a
// compressor's settings, a sharded unit) before it exchanges buffers whose
// sizes depend on it: every rank all-gathers a few words, compares them
// itself, and throws on every rank naming each group of ranks with its value
// ("rank 0: dp=1 tp=2; ranks 1, 2: dp=2 tp=1") instead of one rank failing
// and the others waiting for it.
//
// The all-gather is a template over the group (anything with size() and
// all_gather_into_tensor(out, in).wait(), such as a Communicator), so that
// this bottom layer needs nothing above it; the comparing and naming is
// plain code in agreement.cpp. Also the one 64-bit FNV-1a digest, which the
// agreements use to compare long values in one word.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace cohort {

/// The standard 64-bit FNV-1a offset basis.
inline constexpr uint64_t kFnv1aBasis = 14695981039346656037ull;
/// The standard 64-bit FNV-1a prime.
inline constexpr uint64_t kFnv1aPrime = 1099511628211ull;

/// 64-bit FNV-1a of `bytes` bytes at `data`, continuing from `seed`.
uint64_t fnv1a(const void* data, size_t bytes, uint64_t seed = kFnv1aBasis);

/// 64-bit FNV-1a of `text`'s characters, continuing from `seed`.
inline uint64_t fnv1a(std::string_view text, uint64_t seed = kFnv1aBasis) {
  return fnv1a(text.data(), text.size(), seed);
}

/// 64-bit FNV-1a of `words`, each as its 8 bytes lowest first (the same on
/// every host), continuing from `seed`.
uint64_t fnv1a_words(const std::vector<int64_t>& words, uint64_t seed = kFnv1aBasis);

/// A 64-bit digest of `bytes` bytes at `data`, for comparing large buffers
/// (a model's parameters) across ranks in one word. fnv1a's byte loop runs
/// at about 1 GB/s; this one mixes 8-byte words in four independent FNV-1a
/// lanes (the tail byte by byte) and folds them with a finalizer: about 20
/// GB/s on one core (256 MiB in 13 ms where it was measured, memory-bound).
/// Two buffers that differ in one word always differ here;
/// it is not a cryptographic hash. Equal bytes give equal digests on hosts of
/// one byte order (cohort's ranks share one).
uint64_t content_digest(const void* data, size_t bytes);

/// Every rank's words from one agreement's all-gather, rank-major, each rank
/// the same number (`width`).
class RankWords {
 public:
  /// `all`: `ranks` rows of `all.size() / ranks` words.
  RankWords(std::vector<int64_t> all, int ranks);

  /// Ranks in the group.
  int ranks() const { return ranks_; }
  /// Words per rank.
  size_t width() const { return width_; }
  /// Rank `rank`'s words (`width()` of them).
  const int64_t* of(int rank) const { return all_.data() + static_cast<size_t>(rank) * width_; }
  /// Whether every rank passed the same words.
  bool same() const;
  /// Per rank, `value(that rank's words)`.
  std::vector<std::string> values(const std::function<std::string(const int64_t*)>& value) const;

 private:
  std::vector<int64_t> all_;
  int ranks_;
  size_t width_;
};

/// `v` as the shortest text that reads back as it (0.1, 1e-07), so that two
/// doubles that differ (an option compared by its bits) never print alike.
std::string double_text(double v);

/// Whether every entry of `values` (one per rank) is the same.
bool all_same(const std::vector<std::string>& values);

/// "rank 0: a; ranks 1, 2: b": each group of ranks that have the same value
/// (`values`, one per rank), in the order of each group's first rank.
std::string name_groups(const std::vector<std::string>& values);

/// "rank 2" or "ranks 0, 2": the ranks whose entry of `flags` (one per rank)
/// is set; "" when none is. For naming the ranks that refused to go on.
std::string flagged_ranks(const std::vector<char>& flags);

/// Collective over `group`: every rank's `mine` (the same number of words
/// on every rank).
template <class Group>
RankWords gather_words(Group& group, const std::vector<int64_t>& mine) {
  at::Tensor local = at::empty({static_cast<int64_t>(mine.size())}, at::kLong);
  std::copy(mine.begin(), mine.end(), local.data_ptr<int64_t>());
  at::Tensor all = at::empty({group.size() * local.numel()}, at::kLong);
  group.all_gather_into_tensor(all, local).wait();
  const int64_t* d = all.data_ptr<int64_t>();
  return RankWords(std::vector<int64_t>(d, d + all.numel()), group.size());
}

/// Collective over `group` (two all-gathers: the lengths, then the words
/// padded to the longest): every rank's `mine`, whose length may differ
/// across ranks.
template <class Group>
std::vector<std::vector<int64_t>> gather_varying_words(Group& group,
                                                       const std::vector<int64_t>& mine) {
  const RankWords lengths = gather_words(group, {static_cast<int64_t>(mine.size())});
  int64_t longest = 0;
  for (int r = 0; r < lengths.ranks(); ++r) longest = std::max(longest, lengths.of(r)[0]);
  std::vector<int64_t> padded(mine);
  padded.resize(static_cast<size_t>(longest), -1);
  const RankWords all = gather_words(group, padded);
  std::vector<std::vector<int64_t>> out;
  for (int r = 0; r < all.ranks(); ++r) out.emplace_back(all.of(r), all.of(r) + lengths.of(r)[0]);
  return out;
}

/// Collective over `group` (two all-gathers): every rank's `text`, whose
/// length may differ across ranks.
template <class Group>
std::vector<std::string> gather_texts(Group& group, const std::string& text) {
  // Eight characters a word, lowest byte first; the first word the length.
  std::vector<uint64_t> packed((text.size() + 7) / 8, 0);
  for (size_t i = 0; i < text.size(); ++i) {
    packed[i / 8] |= uint64_t{static_cast<unsigned char>(text[i])} << (8 * (i % 8));
  }
  std::vector<int64_t> words{static_cast<int64_t>(text.size())};
  for (uint64_t w : packed) words.push_back(static_cast<int64_t>(w));
  std::vector<std::string> out;
  for (const auto& w : gather_varying_words(group, words)) {
    std::string t(static_cast<size_t>(w[0]), '\0');
    for (size_t i = 0; i < t.size(); ++i) {
      t[i] = static_cast<char>((static_cast<uint64_t>(w[1 + i / 8]) >> (8 * (i % 8))) & 0xff);
    }
    out.push_back(std::move(t));
  }
  return out;
}

/// The words agree_text gathers for `text`: its length, its FNV-1a and its
/// first characters (texts longer than that still compare by the digest).
std::vector<int64_t> text_words(const std::string& text);

/// Throws InvalidArgument "<who>ranks disagree on <what> (rank 0: a; ranks
/// 1, 2: b)" unless every rank's text_words are the same.
void check_same_text(const RankWords& all, const std::string& who, const std::string& what);

/// Collective over `group` (one all-gather; none at size 1): throws on every
/// rank when the ranks passed different `text` (check_same_text).
template <class Group>
void agree_text(Group& group, const std::string& text, const std::string& who,
                const std::string& what) {
  if (group.size() == 1) return;
  check_same_text(gather_words(group, text_words(text)), who, what);
}

}  // namespace cohort
