// defines: check_signature, the MPI engine's comparison of a collective's
// signature (cohort/core/signature.h) across ranks before MPI sees its
// data: ranks whose collectives differ in size make MPI truncate or hang,
// and one of another kind or root meets an MPI call that does not match.
//
// One MPI_Ialltoall of 32 bytes per peer, which every collective calls alike
// (its sizes never differ): row q is this rank's signature as sent to rank q
// (an all_to_all's elements for q). Each rank compares every other rank's
// itself, so all of them refuse a collective that any two called differently.
#pragma once

#include <vector>

#include "cohort/comm/mpi/op.h"
#include "cohort/core/engine.h"
#include "cohort/core/signature.h"

namespace cohort::mpi {

// Null when every rank of `comm` called the collective `s` (its seq set) as
// this rank did; else a finished Work that throws MismatchError naming both
// calls, or PeerError when the exchange itself failed. `send` and `recv`
// (an all_to_all's elements per peer) may be empty. `op` names the exchange
// for the watchdog; a peer that does not call within `timeout` is a
// TimeoutError.
WorkPtr check_signature(MPI_Comm comm, int rank, int size, const Signature& s,
                        const std::vector<int64_t>& send, const std::vector<int64_t>& recv,
                        const std::shared_ptr<MpiOp>& op, Millis timeout);

}  // namespace cohort::mpi
