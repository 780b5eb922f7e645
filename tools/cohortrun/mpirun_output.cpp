#include "mpirun_output.h"

#include <unistd.h>

#include <cctype>
#include <optional>

#include "output.h"

namespace cohortrun {
namespace {

// Longer than any tag Open MPI writes ("[4294967295,2147483647]<stddiag>:").
constexpr size_t kMaxTagBytes = 48;

struct Tag {
  size_t length;
  int rank;
};

// The tag "[digits,digits]<letters>:" at the start of `s`: nullopt when `s`
// does not start with one; `incomplete` set when `s` ends inside what may
// still become one.
std::optional<Tag> match_tag(std::string_view s, bool space_after, bool& incomplete) {
  incomplete = false;
  size_t i = 0;
  auto at = [&](size_t k) { return k < s.size(); };
  auto digits = [&]() {
    const size_t start = i;
    while (at(i) && std::isdigit(static_cast<unsigned char>(s[i]))) ++i;
    return i > start;
  };
  auto expect = [&](char c) { return at(i) && s[i] == c && ++i; };
  auto ran_out = [&]() {
    incomplete = !at(i) && s.size() < kMaxTagBytes;
    return std::nullopt;
  };
  if (!expect('[')) return ran_out();
  std::string_view rank_text;
  if (!digits() || !expect(',')) return ran_out();
  const size_t rank_start = i;
  if (!digits()) return ran_out();
  rank_text = s.substr(rank_start, i - rank_start);
  if (!expect(']') || !expect('<')) return ran_out();
  const size_t name_start = i;
  while (at(i) && std::isalpha(static_cast<unsigned char>(s[i]))) ++i;
  if (i == name_start || !expect('>') || !expect(':')) return ran_out();
  if (space_after && !expect(' ')) return ran_out();
  if (rank_text.size() > 9) return std::nullopt;  // not a rank of ours
  return Tag{i, std::stoi(std::string(rank_text))};
}

}  // namespace

void MpirunOutput::feed(std::string_view data) {
  pending_.append(data);
  const std::string_view text(pending_);
  size_t start = 0;  // first byte not yet handed to a rank
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == '\n') {
      emit(text.substr(start, i + 1 - start));  // the line's end goes to its rank
      current_ = kMpirun;                       // what follows has no tag yet
      start = ++i;
    } else if (text[i] == '[') {
      bool incomplete = false;
      const std::optional<Tag> tag = match_tag(text.substr(i), space_after_tag_, incomplete);
      if (incomplete) break;  // wait for the rest of a possible tag
      if (!tag) {
        ++i;
        continue;
      }
      emit(text.substr(start, i - start));
      current_ = tag->rank;
      start = i += tag->length;
    } else {
      ++i;
    }
  }
  emit(text.substr(start, i - start));
  pending_.erase(0, i);
}

void MpirunOutput::flush() {
  emit(pending_);
  pending_.clear();
  for (auto& [rank, splitter] : lines_) {
    const int r = rank;
    splitter.flush([&](std::string_view line) { on_line(r, line); });
  }
}

void MpirunOutput::emit(std::string_view text) {
  if (text.empty()) return;
  const int rank = current_;
  lines_[rank].feed(text, [&](std::string_view line) { on_line(rank, line); });
}

void MpirunOutput::on_line(int rank, std::string_view line) {
  std::string text = rank == kMpirun ? std::string() : "[" + std::to_string(rank) + "] ";
  text.append(line);
  text.push_back('\n');
  write_all(fd_, text);
}

}  // namespace cohortrun
