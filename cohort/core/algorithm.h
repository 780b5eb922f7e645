// defines: Algorithm, the choice of collective algorithm an operation or a
// communicator asks for, and its names ("engine", "ring", "tree", "hd",
// "hierarchical", "adaptive").
//
// Kept free of other cohort headers: cohort/core/types.h includes it so the
// option structs can carry the choice.
#pragma once

#include <optional>
#include <string>

namespace cohort {

enum class Algorithm {
  Default,          // the communicator's choice (CommunicatorOptions::algorithm)
  Engine,           // the engine's own collective (Gloo's, MPI's)
  Ring,             // ring reduce-scatter + all-gather, segmented
  Tree,             // double binary tree (all_reduce; ring for the others)
  HalvingDoubling,  // recursive halving-doubling (Rabenseifner)
  Hierarchical,     // reduce in each node, all-reduce among leaders, broadcast
  Adaptive,         // picked per (operation, size) by the measured cost model
};

// The operations the algorithms implement (what adaptive calibrates).
enum class Collective { AllReduce, ReduceScatter, AllGather };

std::string to_string(Algorithm a);
std::string to_string(Collective c);
// Accepts the names above (case-sensitive); nullopt for anything else.
std::optional<Algorithm> parse_algorithm(const std::string& name);
// Every concrete algorithm a user can force (not Default, not Adaptive).
inline constexpr Algorithm kFixedAlgorithms[] = {Algorithm::Engine, Algorithm::Ring,
                                                 Algorithm::Tree, Algorithm::HalvingDoubling,
                                                 Algorithm::Hierarchical};

}  // namespace cohort
