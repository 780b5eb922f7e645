#include "cohort/core/algorithm.h"

namespace cohort {

std::string to_string(Algorithm a) {
  switch (a) {
    case Algorithm::Default:
      return "default";
    case Algorithm::Engine:
      return "engine";
    case Algorithm::Ring:
      return "ring";
    case Algorithm::Tree:
      return "tree";
    case Algorithm::HalvingDoubling:
      return "hd";
    case Algorithm::Hierarchical:
      return "hierarchical";
    case Algorithm::Adaptive:
      return "adaptive";
  }
  return "unknown";
}

std::string to_string(Collective c) {
  switch (c) {
    case Collective::AllReduce:
      return "all_reduce";
    case Collective::ReduceScatter:
      return "reduce_scatter";
    case Collective::AllGather:
      return "all_gather";
  }
  return "unknown";
}

std::optional<Algorithm> parse_algorithm(const std::string& name) {
  for (auto a : {Algorithm::Default, Algorithm::Engine, Algorithm::Ring, Algorithm::Tree,
                 Algorithm::HalvingDoubling, Algorithm::Hierarchical, Algorithm::Adaptive}) {
    if (to_string(a) == name) return a;
  }
  return std::nullopt;
}

}  // namespace cohort
