#!/usr/bin/env bash
# Runs cohort under a real Slurm on this host: munged with a fresh key,
# slurmctld and slurmd with a generated slurm.conf (one node, this host,
# 4 CPUs), all their files in a temporary folder. Then:
#   srun -n 4 ddp_train    every task is its own rank of a world of 4, and
#                          the replicas agree (ddp_train checks it);
#   sbatch -n 4            the batch script itself, not a job step, refuses
#                          to be a rank of 4;
#   examples/slurm/train.sbatch trains (srun inside a batch script);
#   srun cohortrun -n 4    cohortrun's ranks are its own, not the step's.
# Usage: slurm_test.sh DDP_TRAIN COHORTRUN. Exit 77 (skipped) when not root
# or Slurm is not installed. Runs in the Debian 13 lane's chroot too: it
# needs root, /proc and loopback, which the chroot shares with the host.
set -euo pipefail
train=$1 cohortrun=$2

if [ "$(id -u)" -ne 0 ]; then
  echo "slurm_test: skipped: slurmd runs tasks as root here and munged needs a key only root may own"
  exit 77
fi
for b in munged slurmctld slurmd srun sbatch sinfo; do
  if ! command -v "$b" >/dev/null; then
    echo "slurm_test: skipped: $b is not installed (scripts/install-deps.sh installs Slurm and munge)"
    exit 77
  fi
done

dir=$(mktemp -d /tmp/cohort-slurm.XXXXXX)
chmod 700 "$dir"
pids=()
finish() {
  local status=$?
  # By pid only (other jobs on this host may run their own Slurm), newest
  # first: the Slurm daemons still talk to munged as they stop.
  local i p
  for ((i = ${#pids[@]} - 1; i >= 0; i--)); do
    p=${pids[i]}
    kill "$p" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$p" 2>/dev/null || true
  done
  if [ $status -ne 0 ]; then
    for f in "$dir"/*.log; do echo "--- $f"; tail -n 30 "$f"; done
  fi
  rm -rf "$dir"
  exit $status
}
trap finish EXIT

fail() { echo "slurm_test: FAILED: $*" >&2; exit 1; }

# Two ports the kernel says are free now, for slurmctld and slurmd.
read -r ctld_port slurmd_port < <(/usr/bin/python3 -c '
import socket
s = [socket.socket() for _ in range(2)]
for x in s: x.bind(("127.0.0.1", 0))
print(*[x.getsockname()[1] for x in s])')

host=$(hostname -s)
version=$(slurmd -V | awk '{print $2}')
echo "slurm_test: Slurm $version, munge $(munged -V | awk '{print $1}'), node $host"

head -c 1024 /dev/urandom >"$dir/munge.key"
chmod 400 "$dir/munge.key"
munged --force --key-file "$dir/munge.key" --socket "$dir/munge.socket" \
  --pid-file "$dir/munged.pid" --log-file "$dir/munged.log" --seed-file "$dir/munge.seed"
# munged daemonizes: its pid is in its pid file once the socket is up.
for _ in $(seq 50); do [ -s "$dir/munged.pid" ] && break; sleep 0.1; done
pids+=("$(cat "$dir/munged.pid")")

mkdir -p "$dir/state" "$dir/spool"
export SLURM_CONF=$dir/slurm.conf
cat >"$SLURM_CONF" <<CONF
ClusterName=cohort
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=cohort Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
# Slurm 24.05 and later load a cgroup plugin in slurmd unless told not to.
if [ "${version%%.*}" -ge 24 ]; then echo "CgroupPlugin=disabled" >"$dir/cgroup.conf"; fi

slurmctld -D -i -f "$SLURM_CONF" >"$dir/slurmctld.out.log" 2>&1 &
pids+=($!)
slurmd -D -N "$host" -f "$SLURM_CONF" >"$dir/slurmd.out.log" 2>&1 &
pids+=($!)

# The node registers with slurmctld within a few seconds.
state=""
for _ in $(seq 150); do
  state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 0.1
done
[ "$state" = idle ] || fail "the node is '$state', not idle, after 15 s"
echo "slurm_test: node idle after $SECONDS s"

# Each task's line, "T: ddp_train ok on rank R of 4: ...", T srun's task id:
# every task is the rank Slurm numbered it, in a world of 4, and agrees.
expect_ranks() {  # FILE WHAT
  local r
  for r in 0 1 2 3; do
    grep -q "^ *$r: ddp_train ok on rank $r of 4:" "$1" || fail "$2: task $r is not 'ok on rank $r of 4'"
  done
  [ "$(grep -c 'ddp_train' "$1")" -eq 4 ] || fail "$2: not one line per task"
}

# 1. srun -n 4: four tasks, four ranks.
timeout -k 5 60 srun -n 4 -l "$train" --steps 5 >"$dir/srun.out.log" 2>&1 ||
  fail "srun -n 4 ddp_train: exit $? ($(tail -n 3 "$dir/srun.out.log"))"
expect_ranks "$dir/srun.out.log" "srun -n 4"
echo "slurm_test: srun -n 4 trained, ranks 0..3 agree ($SECONDS s)"

# Waits for batch job $1 to end (sbatch --wait polls only every 10 s).
wait_job() {
  local state=""
  for _ in $(seq 600); do
    state=$(scontrol show job "$1" | grep -o 'JobState=[A-Z]*' || true)
    case $state in JobState=PENDING | JobState=RUNNING | JobState=CONFIGURING | JobState=COMPLETING) ;;
      *) break ;; esac
    sleep 0.1
  done
  [ "$state" = JobState=COMPLETED ] || fail "batch job $1: $state"
}

# 2. The batch script of a 4-task job is one process: the program run in it
# without srun must refuse at once, not wait as rank 0 of 4.
cat >"$dir/batch.sh" <<BATCH
#!/bin/bash
timeout 20 "$train" --steps 1 >"$dir/direct.out.log" 2>&1
echo "direct exit \$?" >>"$dir/direct.out.log"
BATCH
wait_job "$(sbatch --parsable -n 4 -o "$dir/batch.out.log" "$dir/batch.sh")"
grep -q "not in a job step" "$dir/direct.out.log" && grep -q "direct exit 1" "$dir/direct.out.log" ||
  fail "the batch script's own process did not refuse: $(cat "$dir/direct.out.log")"
echo "slurm_test: the batch script refused to be rank 0 of 4 ($SECONDS s)"

# 3. The documented example, on the one node here (sbatch passes the
# environment on).
example=$(dirname "$0")/../../examples/slurm/train.sbatch
job=$(COHORT_BUILD=$(dirname "$(dirname "$(dirname "$train")")") STEPS=3 \
  sbatch --parsable -N 1 -n 4 -o "$dir/example.out.log" "$example")
wait_job "$job"
expect_ranks "$dir/example.out.log" "examples/slurm/train.sbatch"
echo "slurm_test: examples/slurm/train.sbatch trained ($SECONDS s)"

# 4. cohortrun as the step's one task on the node: its ranks are its own
# (RANK wins over the SLURM_ variables they inherit).
timeout -k 5 60 srun -n 1 "$cohortrun" -n 4 --timeout 50 -- "$train" --steps 3 \
  >"$dir/cohortrun.out.log" 2>&1 || fail "srun cohortrun: exit $?"
for r in 0 1 2 3; do
  grep -q "ddp_train ok on rank $r of 4:" "$dir/cohortrun.out.log" ||
    fail "srun cohortrun -n 4: rank $r is not 'ok on rank $r of 4'"
done
echo "slurm_test: srun cohortrun -n 4 trained ($SECONDS s)"
