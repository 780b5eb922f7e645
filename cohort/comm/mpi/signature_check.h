// defines: check_signature, the MPI engine's comparison of a collective's
// signature (cohort/core/signature.h) across ranks before MPI sees its
// data: ranks whose collectives differ in size make MPI truncate or hang,
// and one of another kind or root meets an MPI call that does not match.
//
// 32 bytes each way per peer on point-to-point (the engine's own
// communicator for checks, whose messages never meet the caller's), which
// every collective sends alike: row q is this rank's signature as sent to
// rank q (an all_to_all's elements for q). Each rank compares every other rank's
// itself, so all of them refuse a collective that any two called differently.
#pragma once

#include <vector>

#include "cohort/comm/mpi/op.h"
#include "cohort/core/engine.h"
#include "cohort/core/signature.h"

namespace cohort::mpi {

// The tag of the checks' messages on their communicator.
inline constexpr int kCheckTag = 1;

// Null when every rank of `comm` called the collective `s` (its seq set) as
// this rank did; else a finished Work that throws MismatchError naming both
// calls, or PeerError when the exchange itself failed. `send` and `recv`
// (an all_to_all's elements per peer) may be empty. `op` names the exchange
// for the watchdog; a peer that does not call within `timeout` is a
// TimeoutError naming every peer that did not answer.
WorkPtr check_signature(MPI_Comm comm, int rank, int size, const Signature& s,
                        const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                        const std::shared_ptr<MpiOp>& op, Millis timeout);

// The tag of the liveness probes' messages on the checks' communicator.
inline constexpr int kLivenessTag = 2;

// After collective `seq`'s wait timed out: a rank stopped (SIGSTOP, a
// debugger) or hung inside MPI's own collective, past its signature check,
// leaves every survivor waiting there, and the stuck collective cannot say
// which peer it waits for. Each survivor sends a word to every peer on the
// checks' communicator (which the stuck collective does not use) and waits
// up to `most` for theirs: a peer whose word never came did not answer.
// Returns the text a TimeoutError appends; never throws.
std::string liveness_probe(MPI_Comm comm, int rank, int size, int64_t seq, Millis most);

}  // namespace cohort::mpi
