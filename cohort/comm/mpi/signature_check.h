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

}  // namespace cohort::mpi
