// defines: store_liveness_probe — after a Gloo collective's wait timed out,
// which ranks of the group still answer.
//
// Why through the store: the signature check names a rank that never called
// the collective, but a rank stopped (SIGSTOP, a debugger) or hung after its
// check passed stops inside Gloo's own collective, where every survivor times
// out waiting for its neighbour, which may itself be waiting for the stopped
// rank. Gloo's pairs cannot be asked then (the stuck collective holds them);
// the group's store can. Each rank whose wait timed out marks itself under
// the collective's number and waits a while for the others' marks: a rank
// that never marks did not answer.
#pragma once

#include <cstdint>
#include <string>

#include "cohort/core/store/store.h"

namespace cohort {

/// Publishes this process (this_process()) as `rank`'s in the group's
/// `store`, so that a later probe can tell a silent peer on this machine
/// that exited, was killed or is stopped from one that hangs. Every rank
/// calls it as the group is made.
void publish_process(Store& store, int rank);

/// Marks `rank` alive for collective `seq` of a group of `size` ranks in
/// `store`, then waits up to `most` for the other ranks' marks. Returns the
/// text a TimeoutError appends: "; rank 1 did not answer within 1500 ms: ..."
/// or "; every peer still answers". A silent peer on this machine is named
/// with what its process is: "its process (pid 4242, on this machine)
/// exited or was killed", or "is stopped (SIGSTOP, a debugger)". Never
/// throws: a store that fails makes the text say so instead. Each store
/// request waits `most` at most for its reply: a store whose server is in a
/// stopped process (world rank 0 under torchrun's variables) answers
/// nothing, and the text names that process instead ("; world rank 0 (the
/// store's host) did not answer within 1500 ms: ...", TcpStore::server()).
/// Before returning, it waits for every rank that marked itself alive to
/// finish its own probe (3 * `most` + 1 s in all at most), so that the
/// store's host does not exit while a survivor still reads it.
std::string store_liveness_probe(Store& store, int rank, int size, int64_t seq, Millis most);

}  // namespace cohort
