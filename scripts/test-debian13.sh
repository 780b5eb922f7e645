#!/usr/bin/env bash
# The fresh-Debian-13 path on a Debian 12 machine (root): makes a minimal
# Debian 13 root with debootstrap from the Debian archive apt already uses
# here, copies this checkout into it, and runs ./scripts/test.sh there with
# chroot: the README's set-up and the whole suite against Debian 13's
# LibTorch 2.x. Exits with the suite's status. `.ci/run` runs it after
# ./scripts/test.sh.
#
#   scripts/test-debian13.sh [COMMAND...]   (default ./scripts/test.sh)
#
# COHORT_DEBIAN13_ROOT=DIR keeps the root in DIR and reuses it on the next
# run (its packages and its build/ folder), for developers; without it the
# root is made fresh in /var/tmp and removed on exit. A COMMAND runs in the
# checkout's copy instead of the suite, e.g.
#   bash -c './scripts/install-deps.sh && ./scripts/build.sh'
# (a fresh root has no packages until install-deps.sh has run).
#
# COHORT_DEBIAN_SUITE=forky makes the root from Debian testing instead
# (LibTorch 2.14; a developer's lane, CONTRIBUTING.md), and
# COHORT_DEBIAN_MIRROR names the archive when apt's here lacks that suite.
set -euo pipefail
src=$(cd "$(dirname "$0")/.." && pwd)
"$src/scripts/install-deps.sh"   # debootstrap among them

# The Debian archive apt uses here (the one serving this release's main).
mirror() {
  . /etc/os-release
  apt-get indextargets --format '$(REPO_URI) $(LABEL) $(CODENAME) $(COMPONENT)' 2>/dev/null |
    awk -v c="$VERSION_CODENAME" '$2 == "Debian" && $3 == c && $4 == "main" { print $1; exit }'
}
suite=${COHORT_DEBIAN_SUITE:-trixie}
url=${COHORT_DEBIAN_MIRROR:-$(mirror)}
if [ -z "$url" ]; then
  apt-get update -qq   # no package lists yet
  url=$(mirror)
fi
[ -n "$url" ] || { echo "test-debian13: no Debian archive in apt's sources" >&2; exit 1; }

keep=${COHORT_DEBIAN13_ROOT:-}
if [ -n "$keep" ]; then
  root=$(mkdir -p "$keep" && cd "$keep" && pwd)
else
  root=$(mktemp -d /var/tmp/cohort-debian13.XXXXXX)
fi
# The root's / as a system's (mktemp makes it 0700): package scripts that run
# as their own user (munge's key) must reach /bin/sh.
chmod 755 "$root"
mounted=()
child=
# Ends what runs in the background (debootstrap, the command in the root):
# signals its process group (setsid made it one), waits for the group to
# go, then ends whatever still has its root in ours (a test that made a
# session of its own), so nothing writes into the root while it goes.
stop() {   # SIGNAL
  [ -n "$child" ] || return 0
  kill -"$1" -- -"$child" 2>/dev/null || true
  local t
  for t in $(seq 100); do   # 20 s for ctest to end its tests
    kill -0 -- -"$child" 2>/dev/null || break
    sleep 0.2
  done
  kill -KILL -- -"$child" 2>/dev/null || true
  wait "$child" 2>/dev/null || true
  child=
}
in_root() {   # the pids whose root directory is ours
  local p
  for p in /proc/[0-9]*; do
    [ "$(readlink "$p/root" 2>/dev/null)" = "$root" ] && echo "${p#/proc/}"
  done
  return 0
}
cleanup() {
  stop TERM
  local pids t
  for t in TERM TERM TERM KILL; do
    pids=$(in_root)
    [ -n "$pids" ] || break
    kill -"$t" $pids 2>/dev/null || true
    sleep 1
  done
  # Ours, and any the suite made inside (ip netns mounts run/netns),
  # innermost first.
  local m
  while read -r m; do
    umount "$m" 2>/dev/null || umount -l "$m" || true
  done < <({ printf '%s\n' "${mounted[@]}"; awk -v r="$root/" 'index($2, r) == 1 { print $2 }' /proc/self/mounts; } |
    awk 'NF && !seen[$0]++' | sort -r)
  if [ -z "$keep" ]; then rm -rf --one-file-system "$root"; fi
}
trap cleanup EXIT
trap 'stop INT; exit 130' INT
trap 'stop TERM; exit 143' TERM
# Runs COMMAND... in its own session and process group, in the background
# so that a signal to this script is handled at once; returns its status.
# The session keeps this script's nice value: with the kernel's autogroups
# a new session otherwise competes for the CPU as an equal of every other
# (`nice ./scripts/test-debian13.sh` in .ci/run means "only idle cores").
run_group() {
  setsid bash -c 'echo "$(nice)" >/proc/self/autogroup 2>/dev/null; exec "$@"' bash "$@" &
  child=$!
  local status=0
  wait "$child" || status=$?
  child=
  return $status
}
mount_in() {   # TYPE SOURCE PATH [OPTIONS]
  mkdir -p "$root/$3"
  mount -t "$1" ${4:+-o "$4"} "$2" "$root/$3"
  mounted+=("$root/$3")
}

start=$SECONDS
if [ ! -x "$root/usr/bin/apt-get" ]; then
  echo "test-debian13: debootstrap $suite from $url into $root"
  # (Debian 12's debootstrap has no script for suites newer than 13:
  # every suite since 10 uses sid's.)
  script=/usr/share/debootstrap/scripts/$suite
  [ -e "$script" ] || script=/usr/share/debootstrap/scripts/sid
  run_group debootstrap --variant=minbase "$suite" "$root" "$url" "$script" >"$root/debootstrap.log" 2>&1 ||
    { tail -20 "$root/debootstrap.log" >&2; exit 1; }
  echo "test-debian13: root made in $((SECONDS - start)) s"
fi
cp /etc/resolv.conf "$root/etc/resolv.conf"   # for apt inside
# A testing suite's Release file is valid for a week; a frozen copy of
# the archive (this machine's) serves it past that date.
echo 'Acquire::Check-Valid-Until "false";' >"$root/etc/apt/apt.conf.d/99cohort-valid-until"
# Packages installed inside start no services (munge's, Slurm's): a daemon
# started in the root would outlive it. The Slurm test starts its own.
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod 755 "$root/usr/sbin/policy-rc.d"

# The checkout as git sees it (tracked and untracked files, not ignored
# ones such as build/), and a repository so the FetchContent check can
# clone it. The repository is a clone, not a copy of .git: git writes into
# .git while it runs (an index refresh), and CI's other lane runs git at
# the same time. A kept root keeps its build/ folder, and of its copy
# only the files whose contents changed are written, stamped now: tar
# restores the checkout's times, which are older than the objects a
# previous run built from a file edited while that run went on.
dest=$root/cohort
stage=$root/cohort.new
rm -rf "$stage" "$dest/.git"
mkdir -p "$stage" "$dest"
git -C "$src" ls-files -z --cached --others --exclude-standard |
  tar -C "$src" --null -T - -c | tar -C "$stage" -x
(cd "$stage" && find . -type f -print0) | while IFS= read -r -d '' f; do
  cmp -s "$stage/$f" "$dest/$f" && continue
  mkdir -p "$(dirname "$dest/$f")"
  cp -f --preserve=mode "$stage/$f" "$dest/$f"
done
(cd "$dest" && find . -path ./build -prune -o -type f -print0) | while IFS= read -r -d '' f; do
  [ -e "$stage/$f" ] || rm -f "$dest/$f"
done
rm -rf "$stage"
git clone -q --no-checkout "$src" "$dest/.clone"
mv "$dest/.clone/.git" "$dest/.git" && rmdir "$dest/.clone"
git -C "$dest" reset -q   # the index from HEAD; the files stay as copied

# UCX and Open MPI put their shared memory in /dev/shm and read the
# topology from /proc and /sys.
mount_in proc proc proc
mount_in sysfs sysfs sys ro
mount_in tmpfs tmpfs dev/shm mode=1777

[ $# -gt 0 ] || set -- ./scripts/test.sh
status=0
run_group chroot "$root" /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  HOME=/root LANG=C.UTF-8 TERM="${TERM:-dumb}" \
  /bin/bash -c 'cd /cohort && exec "$@"' bash "$@" || status=$?
echo "test-debian13: '$*' exited $status after $((SECONDS - start)) s"
exit $status
