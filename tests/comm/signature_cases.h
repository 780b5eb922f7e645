// defines: the signature cases, written once: every collective kind called
// differently by one rank (rank 0) than by the others, in size, number of
// calls, dtype, reduce op, root or kind, or (the coalesced forms) in the
// dtypes and sizes of their tensors with the same total; the own-block
// cases, an all_to_all whose rank 0 gives itself a block of one size in its
// input and another in its output; and run_signature_case, which checks
// that every rank gets a MismatchError naming both calls within
// kBoundSeconds (never a completed call, a hang or an abort), or alone an
// InvalidArgument. Driven by ranks as threads over UCX and Gloo
// (signature_test.cpp) and by mpirun over MPI
// (tests/mpi/signature_world.cpp), with COHORT_DEBUG off.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "cohort/comm/communicator.h"

namespace cohort::testing {

struct SignatureCase {
  std::string name;  // "AllReduce_Op"
  // Runs the case on one rank: the collectives every rank agrees on, then
  // the one that differs (rank 0 calls `odd`).
  std::function<void(Communicator&)> prologue;
  std::function<void(Communicator&, bool odd)> call;
  // Words every rank's message must hold, naming both calls: the odd call's
  // and the others' ("reduce_scatter", "max" / "all_reduce", "sum").
  std::vector<std::string> odd_words, usual_words;
  // What every rank's message says of the difference.
  std::string verdict = "the ranks called different collectives";
};

const std::vector<SignatureCase>& signature_cases();
// Calls wrong on rank 0 by themselves, so at every world, 1 included: an
// all_to_all (flat and list forms) whose block from rank 0 to itself has
// another size in the input than in the output, while the blocks between
// ranks agree.
const std::vector<SignatureCase>& own_block_cases();

// Runs `c` on this rank of `comm` and checks its error (GoogleTest
// assertions): a MismatchError on every rank, naming the operation and the
// rank; alone (world 1), an InvalidArgument. Returns the seconds the
// mismatched call took.
double run_signature_case(Communicator& comm, const SignatureCase& c);

// Far above the 2 s bound, so an error that waits for the timeout fails.
inline constexpr auto kSignatureTimeout = std::chrono::seconds(30);
inline constexpr double kBoundSeconds = 2.0;

}  // namespace cohort::testing
