// defines: become_subreaper, kill_stray_children — keeping every process a
// rank starts within the launcher's reach.
#pragma once

#include <sys/types.h>

namespace cohortrun {

// Makes the launcher the parent of any process orphaned below it
// (PR_SET_CHILD_SUBREAPER). A rank's helper left behind when the rank exits
// is then reparented here rather than to init: the launcher reaps it when it
// dies and can find it when tearing the job down.
void become_subreaper();

// SIGKILLs and reaps the launcher's remaining children. Called after the
// ranks' process groups were torn down, it catches what left its group
// (setsid, setpgid) and was orphaned to us, pass after pass until none is
// left (a killed child's children are orphaned to us in turn). Returns how
// many it killed.
int kill_stray_children();

// When the process (a zombie not yet reaped, say) last ran, in ms, from
// /proc/PID/sched, corrected for the skew of the scheduler clock of the CPU
// it ran on, so that processes that ran on different CPUs compare; 0 where
// the kernel does not provide it (then callers keep their own order).
double last_ran_ms(pid_t pid);

}  // namespace cohortrun
