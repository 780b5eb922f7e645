// defines: make_nccl_engine — the NCCL engine, c10d's ProcessGroupNCCL
// behind cohort's Engine (README.md in this folder says why c10d's).
//
// All of c10d's NCCL code is called in c10d_adapter.cpp; this header names
// no c10d type, so the rest of cohort never sees it.
#pragma once

#include <memory>

#include "cohort/core/engine.h"
#include "cohort/core/store/store.h"

namespace cohort {

/// Connects `size` ranks through `store` over NCCL (a collective call: every
/// rank calls it with the same store), on the calling thread's current CUDA
/// device. `timeout` is every operation's and the communicator's. Throws
/// TimeoutError when the ranks do not all connect within it.
std::unique_ptr<Engine> make_nccl_engine(std::shared_ptr<Store> store, int rank, int size,
                                         Millis timeout);

}  // namespace cohort
