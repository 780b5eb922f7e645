#include "rank_env.h"

#include <cstdlib>
#include <utility>

#include "job_token.h"

extern char** environ;

namespace cohortrun {

std::vector<std::string> rank_environment(const Options& options, int local_rank, int restart,
                                          int master_port, int store_fd) {
  const int rank = options.first_rank() + local_rank;
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
    // A descriptor number means nothing in another process: only the value
    // set below for rank 0 may reach a rank.
    if (entry.compare(0, 16, "COHORT_STORE_FD=") == 0) continue;
    if (!is_ours(entry)) env.push_back(std::move(entry));
  }
  for (const auto& [key, value] : ours) env.push_back(key + ("=" + value));
  if (store_fd >= 0 && rank == 0) env.push_back("COHORT_STORE_FD=" + std::to_string(store_fd));
  // Ranks sharing a machine would each start one intra-op thread per core
  // (LibTorch's pool, OpenBLAS) and oversubscribe it; torchrun sets the
  // same default. The user's own value wins.
  if (!omp_set && options.nproc_per_node > 1) env.push_back("OMP_NUM_THREADS=1");
  // The rendezvous store accepts only clients that show this token. The
  // caller's own value wins (several nodes must share one: set it on each);
  // nodes cannot agree on a generated one, so none is made for them.
  const char* inherited = std::getenv("COHORT_STORE_TOKEN");
  if ((inherited == nullptr || *inherited == '\0') && options.nnodes == 1) {
    static const std::string token = new_job_token();
    if (!token.empty()) env.push_back("COHORT_STORE_TOKEN=" + token);
  }
  return env;
}

}  // namespace cohortrun
