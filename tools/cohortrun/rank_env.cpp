#include "rank_env.h"

#include <utility>

extern char** environ;

namespace cohortrun {

std::vector<std::string> rank_environment(const Options& options, int local_rank, int restart,
                                          int master_port) {
  const int rank = options.node_rank * options.nproc_per_node + local_rank;
  const std::pair<const char*, std::string> ours[] = {
      {"RANK", std::to_string(rank)},
      {"WORLD_SIZE", std::to_string(options.world_size())},
      {"LOCAL_RANK", std::to_string(local_rank)},
      {"LOCAL_WORLD_SIZE", std::to_string(options.nproc_per_node)},
      {"GROUP_RANK", std::to_string(options.node_rank)},
      {"MASTER_ADDR", options.master_addr},
      {"MASTER_PORT", std::to_string(master_port)},
      {"COHORT_BACKEND", options.backend},
      {"COHORT_RESTART_COUNT", std::to_string(restart)},
      // Programs written for torchrun read the restart number here.
      {"TORCHELASTIC_RESTART_COUNT", std::to_string(restart)},
  };

  auto is_ours = [&](const std::string& entry) {
    for (const auto& [key, value] : ours) {
      std::string prefix = std::string(key) + "=";
      if (entry.compare(0, prefix.size(), prefix) == 0) return true;
    }
    return false;
  };

  std::vector<std::string> env;
  bool omp_set = false;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string entry = *e;
    if (entry.compare(0, 16, "OMP_NUM_THREADS=") == 0) omp_set = true;
    if (!is_ours(entry)) env.push_back(std::move(entry));
  }
  for (const auto& [key, value] : ours) env.push_back(key + ("=" + value));
  // Ranks sharing a machine would each start one intra-op thread per core
  // (LibTorch's pool, OpenBLAS) and oversubscribe it; torchrun sets the
  // same default. The user's own value wins.
  if (!omp_set && options.nproc_per_node > 1) env.push_back("OMP_NUM_THREADS=1");
  return env;
}

}  // namespace cohortrun
