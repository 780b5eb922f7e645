// defines: EngineWorld and engine_worlds(), the engine × world-size cases a
// collective test runs over with ranks as threads, with their gtest names.
#pragma once

#include <gtest/gtest.h>

#include <ostream>
#include <string>
#include <vector>

#include "support/thread_ranks.h"

namespace cohort::testing {

/// `world` ranks as threads over `backend`.
struct EngineWorld {
  std::string backend;
  int world;
};

/// Gloo, and UCX where it is built, each at every size in `worlds`.
inline std::vector<EngineWorld> engine_worlds(const std::vector<int>& worlds = {1, 2, 3}) {
  std::vector<std::string> backends = {"gloo"};
#ifdef COHORT_WITH_UCX
  backends.push_back("ucx");
#endif
  std::vector<EngineWorld> out;
  for (const auto& b : backends) {
    for (int w : worlds) out.push_back({b, w});
  }
  return out;
}

/// A case's name: "gloo_world3".
inline std::string engine_world_name(const ::testing::TestParamInfo<EngineWorld>& info) {
  return info.param.backend + "_world" + std::to_string(info.param.world);
}

/// How gtest prints a failing case's parameter.
inline void PrintTo(const EngineWorld& c, std::ostream* os) {
  *os << c.backend << " world " << c.world;
}

/// The ranks' options for a case.
inline ThreadRanksOptions options_for(const EngineWorld& c) {
  ThreadRanksOptions o;
  o.backend = c.backend;
  return o;
}

}  // namespace cohort::testing
