// defines: make_gloo_engine, make_file_store — cohort's only doors into c10d.
//
// Every call into LibTorch's c10d lives in c10d_adapter.cpp, so the rest of
// cohort never sees c10d's version-specific classes (ProcessGroup in 1.13,
// Backend in 2.x). Keeping this header free of c10d types is the point.
#pragma once

#include <memory>
#include <string>

#include "cohort/comm/gloo/gloo_options.h"
#include "cohort/core/engine.h"
#include "cohort/core/store/store.h"

namespace cohort {

/// Connects `size` ranks through `store` (a collective call: every rank calls
/// it with the same store). Throws TimeoutError naming the missing ranks.
std::unique_ptr<Engine> make_gloo_engine(std::shared_ptr<Store> store, int rank, int size,
                                         const GlooOptions& options, Millis timeout);

/// A Store kept in a file that every rank can open (file:// rendezvous).
std::shared_ptr<Store> make_file_store(const std::string& path, int world_size,
                                       Millis timeout);

}  // namespace cohort
