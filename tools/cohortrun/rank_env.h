// defines: rank_environment — the torchrun-compatible variables a rank
// starts with.
#pragma once

#include <string>
#include <vector>

#include "options.h"

namespace cohortrun {

// The launcher's environment with RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT, COHORT_BACKEND,
// COHORT_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT set (replacing any
// inherited value), as "KEY=VALUE" strings; plus OMP_NUM_THREADS=1 when
// several ranks share this machine and the caller did not set it; plus a
// fresh COHORT_STORE_TOKEN on a single node unless the caller set one; plus
// COHORT_STORE_FD=store_fd for rank 0 when store_fd >= 0 (the socket its
// store serves on; never inherited from the caller).
std::vector<std::string> rank_environment(const Options& options, int local_rank, int restart,
                                          int master_port, int store_fd = -1);

}  // namespace cohortrun
