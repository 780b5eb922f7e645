// defines: Signature (what a rank calls as its n-th collective of a group:
// kind, dtype, reduce op, root, elements, the layout of a coalesced call's
// tensors, whether an all_to_all's own block differs in and out), its
// encoding as four words, and SignatureScope, through which the
// Communicator tells the engine it calls what the user asked for.
//
// Every engine compares each collective's signature across ranks before any
// data moves where a difference could do harm (Gloo aborts, MPI truncates),
// or alongside the data where it cannot (UCX): ranks that call different
// collectives get a MismatchError naming both calls, never a wrong result.
// The engine sees a sum where the user asked for avg, and float32 where the
// user passed float16; the Communicator's signature says what was asked.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cohort/core/types.h"

namespace cohort {

enum class CollectiveKind : int8_t {
  AllReduce = 1,
  Broadcast,
  Reduce,
  AllGather,
  Gather,
  Scatter,
  AllToAll,
  Barrier,
  ReduceScatter,
  AllReduceCoalesced,
  BroadcastCoalesced,
};

struct Signature {
  int64_t seq = 0;  // 1 for the group's first collective (set by the engine)
  CollectiveKind kind = CollectiveKind::Barrier;
  int dtype = -1;  // at::ScalarType, or -1 (none, or several)
  int op = -1;     // ReduceOp, or -1
  int64_t root = -1;
  // Elements per rank; for all_to_all, those sent to (or expected from) one
  // peer, which the engine fills in per peer; -1 for none.
  int64_t count = -1;
  // A coalesced collective's tensors, each one's dtype and elements in
  // order, hashed (layout_of); 0 for other collectives. The count and dtype
  // alone let ranks whose tensors split the same total differently, or hold
  // its dtypes in another order, read each other's bytes as their own.
  uint32_t layout = 0;
  // An all_to_all whose block from this rank to itself has another size in
  // its input than in its output. No peer's row can show it, so the flag
  // travels in every row: every rank refuses the call, this one too
  // (signatures_agree), none waits for it.
  bool own_block_differs = false;
  // How long the engine waits for the peers' signatures (the operation's
  // timeout; 0: the engine's). Not compared, not sent.
  Millis timeout{0};

  bool operator==(const Signature& o) const {
    return seq == o.seq && kind == o.kind && dtype == o.dtype && op == o.op && root == o.root &&
           count == o.count && layout == o.layout && own_block_differs == o.own_block_differs;
  }
  bool operator!=(const Signature& o) const { return !(*this == o); }
  // "all_reduce (float32, 1024 elements, sum)"
  std::string describe() const;
};

// The signature of a collective on `t` (elements per rank).
Signature signature_of(CollectiveKind kind, const at::Tensor& t, int64_t root = -1,
                       std::optional<ReduceOp> op = std::nullopt);

// The layout of a coalesced collective's tensors: a hash of each one's
// dtype and elements, in order, never 0. 32 bits, so that the signature
// stays four words (a UCX notice carries two of them in one shared-memory
// FIFO entry): two layouts that differ agree here once in 2^32.
uint32_t layout_of(const std::vector<at::Tensor>& ts);

// Whether a collective may run between this rank, which called `mine`, and
// a peer that called `theirs`: the same call, and not an all_to_all whose
// own block differs in and out (on either rank: equal flags do not agree).
bool signatures_agree(const Signature& mine, const Signature& theirs);

// A signature as words: few, so a check fits in one small message. Word 1
// holds kind, dtype and op in a byte each, the layout in the next 32 bits
// and own_block_differs above it.
inline constexpr int kSignatureWords = 4;
void to_words(const Signature& s, int64_t* words);
Signature from_words(const int64_t* words);

// The one collective checker: every engine's check (UCX's messages, Gloo's
// and MPI's exchanges) and debug mode's store check of full calls decide
// and word a difference here.
//
// "rank 1" or "ranks [0, 2]".
std::string name_ranks(const std::vector<int>& ranks);
// "<engine>: collective #3: <who> called X but rank 1 called Y[ (<note>)]:
// the ranks called different collectives": the one wording of two ranks'
// calls that differ (`who`: "this rank", or "rank 2" in a notice).
std::string differing_calls(const std::string& engine, int64_t seq, const std::string& who,
                            const std::string& mine, int peer, const std::string& theirs,
                            const std::string& note = "");
// Why `who` ("this rank", or "rank 2" in a notice), which called `mine`,
// and rank `peer`, which called `theirs`, cannot run their collective
// (!signatures_agree): differing_calls of the two (theirs.seq < 0: a peer's
// message that did not describe its collective; another seq is named;
// tensors of another layout say so), or the all_to_all whose own block
// differs in and out. `note` is added to the parenthesis.
std::string mismatch_message(const std::string& engine, const Signature& mine, int peer,
                             const Signature& theirs, const std::string& who = "this rank",
                             const std::string& note = "");
// Every rank's call as text (debug mode's full calls, with shapes): empty
// when all are the same, else differing_calls of this rank's and the first
// peer's that differs, with each group of ranks and its call as the note
// ("ranks [0, 2] called X; rank 1 called Y").
std::string compare_calls(const std::string& engine, int64_t seq, int rank,
                          const std::vector<std::string>& calls);

// An exchange with every peer (engines over point-to-point): row q of
// `rows` (size x kSignatureWords) is what this rank sends rank q, `s` with
// the count send[q] when given (an all_to_all's elements per peer).
void fill_rows(const Signature& s, const std::vector<int64_t>& send, int size, int64_t* rows);
// Row q of `rows` is what rank q sent this rank; compared with `s` (with
// the count recv[q] when given). The mismatch_message of the first peer
// that does not agree (signatures_agree), or empty.
std::string compare_rows(const std::string& engine, const Signature& s,
                         const std::vector<int64_t>& recv, int rank, int size, const int64_t* rows);
// What a timed-out exchange says of the peers whose rows never came: "rank
// 1 did not answer within 3000 ms: stopped (SIGSTOP, a debugger), hung, or
// not calling this collective". A rank in a collective sends its row at
// once, so every waiting rank names the same silent ones.
std::string silent_peers_message(const std::vector<int>& silent, Millis waited,
                                 const std::string& not_doing = "calling this collective");

// The signature of the collective the Communicator is issuing on this
// thread, for the engine call it makes inside the scope. The first engine
// collective takes it (take_signature); one with none describes itself from
// its arguments (the algorithms' private engine, calibration).
class SignatureScope {
 public:
  explicit SignatureScope(const Signature& s);
  ~SignatureScope();
  SignatureScope(const SignatureScope&) = delete;
  SignatureScope& operator=(const SignatureScope&) = delete;
};
std::optional<Signature> take_signature();
// What an engine collective checks: the signature the Communicator gave
// (take_signature), else signature_of its arguments.
Signature given_or(CollectiveKind kind, const at::Tensor& t, int64_t root = -1,
                   std::optional<ReduceOp> op = std::nullopt);

// The dtype the caller of a send or recv passed, which the engine's wire view
// may hide (bf16 moves as f16 bits: movement_view): the Communicator sets
// it around its engine call, and an engine that describes its messages
// (UCX's tags) or names them in errors (MPI) reads it. A thread-local
// store and restore: nothing an engine pays for.
class CallerDtypeScope {
 public:
  explicit CallerDtypeScope(at::ScalarType dtype);
  ~CallerDtypeScope();
  CallerDtypeScope(const CallerDtypeScope&) = delete;
  CallerDtypeScope& operator=(const CallerDtypeScope&) = delete;

 private:
  int outer_;
};
// The caller's dtype inside a CallerDtypeScope, else `wire`.
at::ScalarType caller_dtype_or(at::ScalarType wire);

// What a receive's message and buffer disagree about, for both ranks'
// errors: "the message (40 bytes, int32) <is> another dtype than <the
// receive buffer> (40 bytes, float32): ..." or "... larger than ...". A
// dtype < 0 is left unnamed.
std::string bad_message(int64_t received, int sender_dtype, int64_t bytes, int receiver_dtype,
                        const std::string& message_is, const std::string& buffer);

}  // namespace cohort
