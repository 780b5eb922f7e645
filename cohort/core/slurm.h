// defines: slurm::expand_nodelist, slurm::default_port, slurm::job_step:
// the world a Slurm job step describes, read from srun's environment.
//
// Plain C++ (no LibTorch): cohortrun compiles this file too.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace cohort::slurm {

/// Expands Slurm's compressed host list, in order: "n[01-03,07],gpu5-ib"
/// is n01 n02 n03 n07 gpu5-ib; "n[1-2]-ib" is n1-ib n2-ib. Zero padding is
/// kept (as wide as the range's first bound). Throws ConfigError naming the
/// list for malformed input (unbalanced or nested brackets, an empty or
/// descending range, a non-digit bound) or more than 65536 hosts.
std::vector<std::string> expand_nodelist(const std::string& list);

/// The rendezvous port of a job step when MASTER_PORT is not set:
///   20000 + 10 * (job_id mod 1000) + (step_id mod 10),
/// in [20000, 29999]: unprivileged, below Linux's ephemeral ports (32768
/// and up, where the kernel picks clients' ports), the same on every task
/// of the step with no message, and different for steps of one job that
/// run side by side (up to 10) and for jobs on one master host whose ids
/// differ by less than 1000.
int default_port(unsigned long long job_id, unsigned long long step_id);

/// What one task of a job step is.
struct Step {
  int rank = 0;                    ///< SLURM_PROCID
  int size = 0;                    ///< SLURM_STEP_NUM_TASKS, else SLURM_NTASKS
  int local_rank = 0;              ///< SLURM_LOCALID (0 when unset)
  std::vector<std::string> hosts;  ///< SLURM_STEP_NODELIST, else SLURM_JOB_NODELIST
  /// Where the store listens: MASTER_ADDR, else 127.0.0.1 on one host, else
  /// hosts[0], which every task reads alike whatever the task layout (block,
  /// cyclic, plane, arbitrary, or one a topology plugin ordered).
  std::string master_addr;
  /// Whether this task serves the store: task 0 where MASTER_ADDR is set or
  /// the step has one host, else the task of hosts[0] with SLURM_LOCALID 0
  /// (every node of a step runs a task), wherever task 0 runs.
  bool serves_store = false;
  /// Why this task cannot tell whether it serves the store (empty when it
  /// can), asking for MASTER_ADDR. The same on every task of a step: it
  /// names variables srun sets on every task or on none.
  std::string master_unknown;
  int master_port = 0;  ///< MASTER_PORT, else default_port(SLURM_JOB_ID, SLURM_STEP_ID)
};

/// Reads one variable; nullopt when unset or empty.
using Lookup = std::function<std::optional<std::string>(const char*)>;
/// The process environment as a Lookup.
std::optional<std::string> from_environment(const char* name);

/// The step this process is a task of, or nullopt outside a job step
/// (SLURM_STEP_ID unset, or one of Slurm's own steps, whose ids Slurm 26
/// prints negative): a batch script or an salloc shell is one process
/// however many tasks the job has. Throws ConfigError, naming the variable,
/// for a missing or malformed one or a SLURM_PROCID not below the task count
/// (not for an unknown store server: Step::master_unknown).
std::optional<Step> job_step(const Lookup& env = from_environment);

}  // namespace cohort::slurm
