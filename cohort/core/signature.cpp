#include "cohort/core/signature.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "cohort/core/agreement.h"
#include "cohort/core/tensor_checks.h"

namespace cohort {
namespace {

const char* kind_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::AllReduce:
      return "all_reduce";
    case CollectiveKind::Broadcast:
      return "broadcast";
    case CollectiveKind::Reduce:
      return "reduce";
    case CollectiveKind::AllGather:
      return "all_gather";
    case CollectiveKind::Gather:
      return "gather";
    case CollectiveKind::Scatter:
      return "scatter";
    case CollectiveKind::AllToAll:
      return "all_to_all";
    case CollectiveKind::Barrier:
      return "barrier";
    case CollectiveKind::ReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::AllReduceCoalesced:
      return "all_reduce_coalesced";
    case CollectiveKind::BroadcastCoalesced:
      return "broadcast_coalesced";
  }
  return "an unknown collective";
}

thread_local std::optional<Signature> t_signature;
thread_local int t_caller_dtype = -1;

}  // namespace

std::string Signature::describe() const {
  std::string s = kind_name(kind);
  std::string args;
  auto add = [&](const std::string& a) { args += (args.empty() ? "" : ", ") + a; };
  // A peer's signature comes off the wire: name what is out of range as a number.
  if (dtype >= 0 && dtype < static_cast<int>(at::NumScalarTypes)) {
    add(dtype_name(static_cast<at::ScalarType>(dtype)));
  } else if (dtype >= 0) {
    add("dtype " + std::to_string(dtype));
  }
  if (count >= 0) add(std::to_string(count) + (count == 1 ? " element" : " elements"));
  if (op >= 0 && op <= static_cast<int>(ReduceOp::Prod)) {
    add(to_string(static_cast<ReduceOp>(op)));
  } else if (op >= 0) {
    add("op " + std::to_string(op));
  }
  if (root >= 0) add("root " + std::to_string(root));
  if (layout != 0) {
    char hex[16];
    std::snprintf(hex, sizeof hex, "%08x", layout);
    add(std::string("layout ") + hex);
  }
  return args.empty() ? s : s + " (" + args + ")";
}

uint32_t layout_of(const std::vector<at::Tensor>& ts) {
  std::vector<int64_t> words;
  words.reserve(2 * ts.size());
  for (const auto& t : ts) {
    words.push_back(static_cast<int64_t>(t.scalar_type()));
    words.push_back(t.numel());
  }
  const uint64_t h = fnv1a_words(words);
  const auto folded = static_cast<uint32_t>(h ^ (h >> 32));
  return folded == 0 ? 1 : folded;  // 0 means no layout
}

bool signatures_agree(const Signature& mine, const Signature& theirs) {
  return mine == theirs && !mine.own_block_differs;
}

Signature signature_of(CollectiveKind kind, const at::Tensor& t, int64_t root,
                       std::optional<ReduceOp> op) {
  Signature s;
  s.kind = kind;
  s.dtype = static_cast<int>(t.scalar_type());
  s.count = t.numel();
  s.root = root;
  s.op = op ? static_cast<int>(*op) : -1;
  return s;
}

// Word 1: kind, dtype + 1 and op + 1 in a byte each (-1 is 0), the layout
// in bits 24-55, own_block_differs in bit 56.
void to_words(const Signature& s, int64_t* w) {
  w[0] = s.seq;
  w[1] = static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint8_t>(s.kind)) |
                              (uint64_t{static_cast<uint8_t>(s.dtype + 1)} << 8) |
                              (uint64_t{static_cast<uint8_t>(s.op + 1)} << 16) |
                              (uint64_t{s.layout} << 24) | (uint64_t{s.own_block_differs} << 56));
  w[2] = s.root;
  w[3] = s.count;
}

Signature from_words(const int64_t* w) {
  Signature s;
  const auto w1 = static_cast<uint64_t>(w[1]);
  s.seq = w[0];
  s.kind = static_cast<CollectiveKind>(w1 & 0xff);
  s.dtype = static_cast<int>((w1 >> 8) & 0xff) - 1;
  s.op = static_cast<int>((w1 >> 16) & 0xff) - 1;
  s.layout = static_cast<uint32_t>(w1 >> 24);
  s.own_block_differs = ((w1 >> 56) & 1) != 0;
  s.root = w[2];
  s.count = w[3];
  return s;
}

std::string name_ranks(const std::vector<int>& ranks) {
  std::string s = ranks.size() == 1 ? "rank " : "ranks [";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return ranks.size() == 1 ? s : s + "]";
}

std::string differing_calls(const std::string& engine, int64_t seq, const std::string& who,
                            const std::string& mine, int peer, const std::string& theirs,
                            const std::string& note) {
  return engine + ": collective #" + std::to_string(seq) + ": " + who + " called " + mine +
         " but rank " + std::to_string(peer) + " called " + theirs +
         (note.empty() ? "" : " (" + note + ")") + ": the ranks called different collectives";
}

std::string mismatch_message(const std::string& engine, const Signature& mine, int peer,
                             const Signature& theirs, const std::string& who,
                             const std::string& note) {
  const std::string what =
      theirs.seq == mine.seq ? theirs.describe()
      : theirs.seq < 0       ? "a collective it did not describe"
                       : theirs.describe() + " as its collective #" + std::to_string(theirs.seq);
  // The same call but for `field`: what names the difference.
  auto only = [&](auto field) {
    Signature a = mine, b = theirs;
    field(a) = field(b);
    return a == b;
  };
  const auto own = [](Signature& s) -> bool& { return s.own_block_differs; };
  if (only(own) && (mine.own_block_differs || theirs.own_block_differs)) {
    // The rank whose own block differs first (this one when both do).
    const std::string peer_name = "rank " + std::to_string(peer);
    const bool mine_bad = mine.own_block_differs;
    const std::string bad =
        mine_bad ? who + " called " + mine.describe() : peer_name + " called " + what;
    const std::string other =
        mine_bad ? peer_name + " called " + what : who + " called " + mine.describe();
    return engine + ": collective #" + std::to_string(mine.seq) + ": " + bad +
           " with its own block of another size in its input than in its output (" + other +
           (note.empty() ? "" : "; " + note) +
           "): its input and output must give a rank's own block the same size";
  }
  const auto layout = [](Signature& s) -> uint32_t& { return s.layout; };
  std::string why = note;
  if (mine.layout != theirs.layout && only(layout)) {
    why =
        "the tensors differ in dtype or size, in order or in how they split the total; "
        "COHORT_DEBUG=detail lists each rank's" +
        (note.empty() ? "" : "; " + note);
  }
  return differing_calls(engine, mine.seq, who, mine.describe(), peer, what, why);
}

std::string compare_calls(const std::string& engine, int64_t seq, int rank,
                          const std::vector<std::string>& calls) {
  const auto& mine = calls[static_cast<size_t>(rank)];
  int peer = -1;
  for (size_t q = 0; q < calls.size() && peer < 0; ++q) {
    if (calls[q] != mine) peer = static_cast<int>(q);
  }
  if (peer < 0) return "";
  // Each group of ranks with its call, in the order of each group's first rank.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t q = 0; q < calls.size(); ++q) {
    auto g = std::find_if(groups.begin(), groups.end(),
                          [&](const auto& x) { return x.first == calls[q]; });
    if (g == groups.end()) g = groups.insert(groups.end(), {calls[q], {}});
    g->second.push_back(static_cast<int>(q));
  }
  std::string note;
  for (const auto& [call, ranks] : groups) {
    note += (note.empty() ? "" : "; ") + name_ranks(ranks) + " called " + call;
  }
  return differing_calls(engine, seq, "this rank", mine, peer, calls[static_cast<size_t>(peer)],
                         note);
}

namespace {
Signature with_count(Signature s, const std::vector<int64_t>& counts, int q) {
  if (!counts.empty()) s.count = counts[static_cast<size_t>(q)];
  return s;
}
}  // namespace

void fill_rows(const Signature& s, const std::vector<int64_t>& send, int size, int64_t* rows) {
  for (int q = 0; q < size; ++q) to_words(with_count(s, send, q), rows + q * kSignatureWords);
}

std::string compare_rows(const std::string& engine, const Signature& s,
                         const std::vector<int64_t>& recv, int rank, int size,
                         const int64_t* rows) {
  for (int q = 0; q < size; ++q) {
    if (q == rank) continue;
    const auto want = with_count(s, recv, q);
    const auto got = from_words(rows + q * kSignatureWords);
    if (!signatures_agree(want, got)) return mismatch_message(engine, want, q, got);
  }
  return "";
}

std::string silent_peers_message(const std::vector<int>& silent, Millis waited,
                                 const std::string& not_doing) {
  return name_ranks(silent) + " did not answer within " + std::to_string(waited.count()) +
         " ms: stopped (SIGSTOP, a debugger), hung, or not " + not_doing;
}

SignatureScope::SignatureScope(const Signature& s) { t_signature = s; }

SignatureScope::~SignatureScope() { t_signature.reset(); }

std::optional<Signature> take_signature() {
  auto s = t_signature;
  t_signature.reset();
  return s;
}

Signature given_or(CollectiveKind kind, const at::Tensor& t, int64_t root,
                   std::optional<ReduceOp> op) {
  if (auto given = take_signature()) return *given;
  return signature_of(kind, t, root, op);
}

CallerDtypeScope::CallerDtypeScope(at::ScalarType dtype) : outer_(t_caller_dtype) {
  t_caller_dtype = static_cast<int>(dtype);
}

CallerDtypeScope::~CallerDtypeScope() { t_caller_dtype = outer_; }

at::ScalarType caller_dtype_or(at::ScalarType wire) {
  return t_caller_dtype < 0 ? wire : static_cast<at::ScalarType>(t_caller_dtype);
}

std::string bad_message(int64_t received, int sender_dtype, int64_t bytes, int receiver_dtype,
                        const std::string& message_is, const std::string& buffer) {
  auto described = [](int64_t n, int dtype) {
    return "(" + std::to_string(n) + " bytes" +
           (dtype < 0 ? "" : ", " + dtype_name(static_cast<at::ScalarType>(dtype))) + ")";
  };
  if (received == bytes) {
    return "the message " + described(received, sender_dtype) + " " + message_is +
           " of another dtype than " + buffer + " " + described(bytes, receiver_dtype) +
           ": the ranks sent and received different dtypes";
  }
  return "the message " + described(received, sender_dtype) + " " + message_is + " " +
         (received > bytes ? "larger" : "shorter") + " than " + buffer + " " +
         described(bytes, receiver_dtype) + ": the ranks called different operations or sizes";
}

}  // namespace cohort
