// defines: the signature cases, written once: every collective kind called
// differently by one rank (rank 0) than by the others, in size, number of
// calls, dtype, reduce op, root or kind, and run_signature_case, which
// checks that every rank gets a MismatchError naming both calls within
// kBoundSeconds (never a completed call, a hang or an abort). Driven by
// ranks as threads over UCX and Gloo (signature_test.cpp) and by mpirun over
// MPI (tests/mpi/signature_world.cpp), with COHORT_DEBUG off.
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
};

const std::vector<SignatureCase>& signature_cases();

// Runs `c` on this rank of `comm` and checks its error (GoogleTest
// assertions); returns the seconds the mismatched call took.
double run_signature_case(Communicator& comm, const SignatureCase& c);

// Far above the 2 s bound, so an error that waits for the timeout fails.
inline constexpr auto kSignatureTimeout = std::chrono::seconds(30);
inline constexpr double kBoundSeconds = 2.0;

}  // namespace cohort::testing
