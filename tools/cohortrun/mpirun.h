// defines: mpirun_command, run_mpirun — the --backend mpi handoff.
#pragma once

#include <string>
#include <vector>

#include "options.h"

namespace cohortrun {

// mpirun -np N [--allow-run-as-root] [--oversubscribe]
//        --mca btl_tcp_if_include lo
//        --tag-output -x COHORT_BACKEND=mpi -x COHORT_PROGRESS=lines
//        PROGRAM ARGS...
// Open MPI refuses to run as root without the first flag, and refuses more
// ranks than cores without the second; each is added only when needed so
// that mpirun's own safety checks stay on otherwise. The --mca option, and
// OMPI_MCA_oob_tcp_if_include=lo in mpirun's environment (run_mpirun), keep
// a single-node job's sockets on loopback.
std::vector<std::string> mpirun_command(const Options& options, bool as_root, long online_cores);

// Runs mpirun, which starts and supervises the ranks, and returns its exit
// code (127 when mpirun is not on PATH). The launcher stays to prefix each
// line of the ranks' output with "[rank] " as the Gloo path does (from the
// tags of --tag-output), and passes SIGINT, SIGTERM and SIGHUP on to mpirun.
int run_mpirun(const Options& options);

}  // namespace cohortrun
