#include "cohort/grad_sync/gradient_presence.h"

#include <torch/types.h>

#include <algorithm>

#include "cohort/comm/communicator.h"
#include "cohort/core/agreement.h"
#include "cohort/core/error.h"

namespace cohort {
namespace {

// The kinds another rank can rethrow, by the word that carries them.
enum FailureKind : char { kNone, kStage, kInvalid, kTimeout, kPeer, kOther };

FailureKind kind_of(const std::exception_ptr& failed, std::string& what) {
  if (!failed) return kNone;
  try {
    std::rethrow_exception(failed);
  } catch (const StageError& e) {
    what = e.what();
    return kStage;
  } catch (const InvalidArgument& e) {
    what = e.what();
    return kInvalid;
  } catch (const TimeoutError& e) {
    what = e.what();
    return kTimeout;
  } catch (const PeerError& e) {
    what = e.what();
    return kPeer;
  } catch (const std::exception& e) {
    what = e.what();
  } catch (...) {
    what = "an exception that is no std::exception";
  }
  return kOther;
}

[[noreturn]] void throw_kind(char kind, const std::string& text) {
  switch (kind) {
    case kStage:
      throw StageError(text);
    case kInvalid:
      throw InvalidArgument(text);
    case kTimeout:
      throw TimeoutError(text);
    case kPeer:
      throw PeerError(text);
    default:
      throw Error(text);
  }
}

}  // namespace

std::vector<char> any_rank_has(Communicator& comm, const std::vector<char>& local) {
  auto mask = torch::zeros({static_cast<int64_t>(local.size())}, torch::kInt);
  auto* m = mask.data_ptr<int>();
  for (size_t i = 0; i < local.size(); ++i) m[i] = local[i];
  if (comm.size() > 1) comm.all_reduce(mask, {ReduceOp::Max}).wait();
  return std::vector<char>(m, m + local.size());
}

std::vector<char> any_rank_has_unless_refused(Communicator& comm, const std::vector<char>& local,
                                              const std::string& refusal,
                                              const std::string& where) {
  const size_t n = local.size(), world = static_cast<size_t>(comm.size());
  std::vector<char> words(local);
  words.resize(n + world, 0);
  words[n + static_cast<size_t>(comm.rank())] = refusal.empty() ? 0 : 1;
  auto all = any_rank_has(comm, words);
  if (!refusal.empty()) throw InvalidArgument(where + ": " + refusal);
  const std::vector<char> refused(all.begin() + static_cast<std::ptrdiff_t>(n), all.end());
  const std::string ranks = flagged_ranks(refused);
  if (!ranks.empty()) {
    const bool one = ranks.rfind("rank ", 0) == 0;
    throw InvalidArgument(where + ": " + ranks + " cannot take this step (" +
                          (one ? "its" : "their") + " own error says why), so no rank takes it");
  }
  all.resize(n);
  return all;
}

std::vector<char> any_rank_has_unless_failed(Communicator& comm, const std::vector<char>& local,
                                             const std::exception_ptr& failed,
                                             const std::string& where) {
  std::string what;
  const FailureKind kind = kind_of(failed, what);
  const size_t n = local.size(), world = static_cast<size_t>(comm.size());
  std::vector<char> words(local);
  words.resize(n + world, 0);
  words[n + static_cast<size_t>(comm.rank())] = kind;
  auto all = any_rank_has(comm, words);
  const std::vector<char> kinds(all.begin() + static_cast<std::ptrdiff_t>(n), all.end());
  const auto first = std::find_if(kinds.begin(), kinds.end(), [](char k) { return k != kNone; });
  if (first == kinds.end()) {
    all.resize(n);
    return all;
  }
  // Every rank takes part in the texts' all-gather before any throws.
  const auto texts = gather_texts(comm, what);
  if (failed) std::rethrow_exception(failed);
  std::string text =
      where + ": " + flagged_ranks(kinds) + " of this group failed the step, so no rank takes it: ";
  bool more = false;
  for (const auto& t : texts) {
    if (t.empty()) continue;
    text += (more ? "; " : "") + t;
    more = true;
  }
  throw_kind(*first, text);
}

}  // namespace cohort
