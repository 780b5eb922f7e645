// defines: mpirun_command, exec_mpirun — the --backend mpi handoff.
#pragma once

#include <string>
#include <vector>

#include "options.h"

namespace cohortrun {

// mpirun -np N [--allow-run-as-root] [--oversubscribe]
//        --mca oob_tcp_if_include lo --mca btl_tcp_if_include lo
//        -x COHORT_BACKEND=mpi PROGRAM ARGS...
// Open MPI refuses to run as root without the first flag, and refuses more
// ranks than cores without the second; each is added only when needed so
// that mpirun's own safety checks stay on otherwise. The --mca options keep
// a single-node job's sockets on loopback.
std::vector<std::string> mpirun_command(const Options& options, bool as_root, long online_cores);

// Replaces the launcher with mpirun, which then starts and supervises the
// ranks. Returns only if exec failed, with the exit code to use (127).
int exec_mpirun(const Options& options);

}  // namespace cohortrun
