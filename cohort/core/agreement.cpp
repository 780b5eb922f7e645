#include "cohort/core/agreement.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "cohort/core/error.h"

namespace cohort {

uint64_t fnv1a(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = seed;
  for (size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * kFnv1aPrime;
  return h;
}

uint64_t fnv1a_words(const std::vector<int64_t>& words, uint64_t seed) {
  uint64_t h = seed;
  for (int64_t word : words) {
    for (int b = 0; b < 8; ++b)
      h = (h ^ ((static_cast<uint64_t>(word) >> (8 * b)) & 0xff)) * kFnv1aPrime;
  }
  return h;
}

uint64_t content_digest(const void* data, size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  // Four lanes, so that the multiplications of consecutive words overlap
  // instead of waiting on each other as one chain would.
  uint64_t lane[4] = {kFnv1aBasis, kFnv1aBasis ^ 1, kFnv1aBasis ^ 2, kFnv1aBasis ^ 3};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * kFnv1aPrime;
    }
  }
  uint64_t h = fnv1a(p + i, bytes - i, static_cast<uint64_t>(bytes));
  for (uint64_t l : lane) {
    // splitmix64's finalizer: every bit of a lane reaches every bit of h.
    l ^= l >> 30;
    l *= 0xbf58476d1ce4e5b9ull;
    l ^= l >> 27;
    l *= 0x94d049bb133111ebull;
    l ^= l >> 31;
    h = (h ^ l) * kFnv1aPrime;
  }
  return h;
}

RankWords::RankWords(std::vector<int64_t> all, int ranks)
    : all_(std::move(all)), ranks_(ranks), width_(ranks > 0 ? all_.size() / ranks : 0) {
  COHORT_CHECK(ranks > 0 && width_ * static_cast<size_t>(ranks) == all_.size(),
               "agreement: " << all_.size() << " words do not split into " << ranks << " ranks");
}

bool RankWords::same() const {
  for (int r = 1; r < ranks_; ++r)
    if (!std::equal(of(0), of(0) + width_, of(r))) return false;
  return true;
}

std::vector<std::string> RankWords::values(
    const std::function<std::string(const int64_t*)>& value) const {
  std::vector<std::string> out;
  out.reserve(static_cast<size_t>(ranks_));
  for (int r = 0; r < ranks_; ++r) out.push_back(value(of(r)));
  return out;
}

bool all_same(const std::vector<std::string>& values) {
  return std::all_of(values.begin(), values.end(),
                     [&](const std::string& v) { return v == values.front(); });
}

std::string double_text(double v) {
  char text[32];
  for (int digits = 6; digits <= 17; ++digits) {
    std::snprintf(text, sizeof text, "%.*g", digits, v);
    if (std::strtod(text, nullptr) == v) break;
  }
  return text;
}

std::string name_groups(const std::vector<std::string>& values) {
  std::vector<std::pair<const std::string*, std::vector<int>>> groups;  // value, ranks
  for (int r = 0; r < static_cast<int>(values.size()); ++r) {
    const std::string& v = values[static_cast<size_t>(r)];
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return *g.first == v; });
    if (it == groups.end()) it = groups.insert(groups.end(), {&v, {}});
    it->second.push_back(r);
  }
  std::ostringstream os;
  for (size_t g = 0; g < groups.size(); ++g) {
    const auto& ranks = groups[g].second;
    os << (g ? "; " : "") << (ranks.size() > 1 ? "ranks " : "rank ");
    for (size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
    os << ": " << *groups[g].first;
  }
  return os.str();
}

std::string flagged_ranks(const std::vector<char>& flags) {
  std::string ranks;
  int count = 0;
  for (size_t r = 0; r < flags.size(); ++r) {
    if (flags[r]) ranks += (count++ ? ", " : "") + std::to_string(r);
  }
  if (count == 0) return "";
  return (count > 1 ? "ranks " : "rank ") + ranks;
}

namespace {
constexpr size_t kTextChars = 120;  // shown in the message; the digest covers the rest
constexpr size_t kTextWords = kTextChars + 2;
}  // namespace

std::vector<int64_t> text_words(const std::string& text) {
  std::vector<int64_t> w(kTextWords, 0);
  w[0] = static_cast<int64_t>(text.size());
  w[1] = static_cast<int64_t>(fnv1a(text));
  for (size_t i = 0; i < text.size() && i < kTextChars; ++i)
    w[i + 2] = static_cast<unsigned char>(text[i]);
  return w;
}

void check_same_text(const RankWords& all, const std::string& who, const std::string& what) {
  COHORT_CHECK(all.width() == kTextWords, "agreement: text records of " << all.width() << " words");
  if (all.same()) return;
  const auto values = all.values([](const int64_t* w) {
    const auto size = static_cast<size_t>(w[0]);
    std::string t;
    for (size_t i = 0; i < std::min(size, kTextChars); ++i) t += static_cast<char>(w[i + 2]);
    // Texts that differ after the shown part still form their own groups.
    if (size > kTextChars)
      t += "... (" + std::to_string(size) + " characters, digest " +
           std::to_string(static_cast<uint64_t>(w[1])) + ")";
    return t;
  });
  throw InvalidArgument(who + "ranks disagree on " + what + " (" + name_groups(values) + ")");
}

}  // namespace cohort
