#include "cohort/comm/collective_checker.h"

#include <vector>

#include "cohort/core/error.h"
#include "cohort/core/signature.h"

namespace cohort {
namespace {

// with_blocks puts the blocks after a newline, which no call holds:
// "<call>\n<sends>;<expects>", each a list of numbers with a comma after each.
std::string call_of(const std::string& fingerprint) {
  return fingerprint.substr(0, fingerprint.find('\n'));
}

std::vector<int64_t> numbers(const std::string& list) {
  std::vector<int64_t> out;
  for (size_t at = 0, comma; (comma = list.find(',', at)) != std::string::npos; at = comma + 1) {
    out.push_back(std::stoll(list.substr(at, comma - at)));
  }
  return out;
}

struct Blocks {
  std::vector<int64_t> sends, expects;
};

// The blocks in `fingerprint`; none when it has none.
Blocks blocks_of(const std::string& fingerprint) {
  const auto start = fingerprint.find('\n');
  const auto split = fingerprint.find(';', start);
  if (start == std::string::npos || split == std::string::npos) return {};
  return {numbers(fingerprint.substr(start + 1, split - start - 1)),
          numbers(fingerprint.substr(split + 1))};
}

std::string elements(int64_t n) { return std::to_string(n) + (n == 1 ? " element" : " elements"); }

// "" when each rank's block to each rank has the size that rank expects
// from it, else the first pair that does not, in rank order. `blocks`: every
// rank's, of calls already found alike.
std::string unpaired(const std::string& where, const std::vector<Blocks>& blocks) {
  const size_t size = blocks.size();
  for (size_t r = 0; r < size; ++r) {
    if (blocks[r].sends.size() != size || blocks[r].expects.size() != size) {
      return where + "rank " + std::to_string(r) + " did not pass one block per rank";
    }
  }
  for (size_t i = 0; i < size; ++i) {
    for (size_t j = 0; j < size; ++j) {
      const int64_t sent = blocks[i].sends[j], expected = blocks[j].expects[i];
      if (sent == expected) continue;
      const std::string from = "rank " + std::to_string(i), to = "rank " + std::to_string(j);
      if (i == j) {
        return where + from + " gives its own block " + elements(sent) + " in its input but " +
               std::to_string(expected) +
               " in its output: its input and output must give a rank's own block the same size";
      }
      return where + from + " sends " + to + " " + elements(sent) + " but " + to + " expects " +
             std::to_string(expected) + " from it: the ranks' blocks do not pair up";
    }
  }
  return "";
}

}  // namespace

std::string CollectiveChecker::with_blocks(const std::string& call,
                                           const std::vector<int64_t>& sends,
                                           const std::vector<int64_t>& expects) {
  std::string s = call + "\n";
  for (auto n : sends) s += std::to_string(n) + ",";
  s += ";";
  for (auto n : expects) s += std::to_string(n) + ",";
  return s;
}

CollectiveChecker::CollectiveChecker(std::shared_ptr<Store> store, int rank, int size)
    : store_(std::move(store)), rank_(rank), size_(size) {}

std::string CollectiveChecker::key(uint64_t seq, int rank) const {
  return "debug/" + std::to_string(seq) + "/" + std::to_string(rank);
}

void CollectiveChecker::verify(const std::string& fingerprint, Millis timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t seq = seq_++;
  store_->set_string(key(seq, rank_), fingerprint);

  std::vector<std::string> keys;
  for (int r = 0; r < size_; ++r) keys.push_back(key(seq, r));
  try {
    store_->wait(keys, timeout);
  } catch (const TimeoutError&) {
    std::vector<int> absent;
    for (int r = 0; r < size_; ++r) {
      if (!store_->check({keys[r]})) absent.push_back(r);
    }
    throw TimeoutError("debug check of collective #" + std::to_string(seq) + " (" +
                       call_of(fingerprint) + "): " + name_ranks(absent) +
                       " did not reach it within " + std::to_string(timeout.count()) +
                       " ms (a different number of collectives, or a dead rank)");
  }

  // Every rank has now written `seq`, so all have finished reading seq-1:
  // this rank's old key can go.
  if (seq > 0) store_->delete_key(key(seq - 1, rank_));

  // The one collective checker (core/signature.h) decides and words
  // whether the calls differ; an all_to_all's blocks are paired here.
  std::vector<std::string> calls;
  std::vector<Blocks> blocks;
  for (int r = 0; r < size_; ++r) {
    const auto theirs = r == rank_ ? fingerprint : store_->get_string(keys[r]);
    calls.push_back(call_of(theirs));
    blocks.push_back(blocks_of(theirs));
  }
  std::string differs = compare_calls("debug check", static_cast<int64_t>(seq), rank_, calls);
  if (differs.empty() && call_of(fingerprint) != fingerprint) {
    differs = unpaired("debug check: collective #" + std::to_string(seq) + ": " + calls[0] + ": ",
                       blocks);
  }
  if (!differs.empty()) throw MismatchError(differs);
}

}  // namespace cohort
