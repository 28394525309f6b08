#!/bin/bash
# down.sh -- stop the lab started by up.sh. Kills ONLY what up.sh/node.sh recorded: PIDs in
# $LAB/run/*.pid (checked against their expected program name) plus every process inside
# the per-node UTS namespaces listed in $LAB/run/node*.uts (slurmd, slurmstepd, job tasks).
# Leaves $LAB/etc (and the /etc/slurm/slurm.conf link to it) so stray clients still find a
# config instead of doing DNS SRV look-ups.
set -u
LAB=${LAB:-/tmp/resild-slurm-lab}
RUN=$LAB/run
HOST_UTS=$(readlink /proc/1/ns/uts)
alive() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
pid_if() { # pidfile expected-comm -> prints pid if alive and comm matches
  local f=$1 want=$2 p
  [ -s "$f" ] || return 0
  for p in $(cat "$f"); do
    [[ $p =~ ^[0-9]+$ ]] || continue
    alive "$p" && [[ "$(cat /proc/$p/comm 2>/dev/null)" == $want* ]] && echo "$p"
  done
  return 0
}
ns_members() { # all live pids whose uts ns is one of ours (never the host's)
  local nsl=$1 p ns
  [ -n "$nsl" ] || return 0
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    ns=$(readlink "/proc/$p/ns/uts" 2>/dev/null) || continue
    [ "$ns" = "$HOST_UTS" ] && continue
    grep -qxF "$ns" <<<"$nsl" && alive "$p" && echo "$p"
  done
  return 0
}
NSL=$(cat "$RUN"/node*.uts 2>/dev/null | sort -u | grep -v -xF "$HOST_UTS" || true)
CTLD=$(pid_if "$RUN/slurmctld.pid" slurmctld)
SCRD=$(pid_if "$RUN/slurmscriptd.pid" slurmscriptd)
SLURMDS=$(for f in "$RUN"/slurmd-*.pid; do pid_if "$f" slurmd; done)
MUNGED=$(pid_if "$RUN/munged.pid" munged)
NODEP=$(ns_members "$NSL")
ALL=$(echo $CTLD $SCRD $SLURMDS $NODEP $MUNGED | tr ' ' '\n' | sort -un | tr '\n' ' ')
if [ -z "${ALL// /}" ]; then echo "down: nothing running"; rm -f "$RUN"/*.pid "$RUN"/*.uts; exit 0; fi
echo "down: TERM $ALL"
# frozen node processes would ignore TERM until thawed
[ -n "$NODEP" ] && kill -CONT $NODEP 2>/dev/null
# slurmd/stepd/tasks first, then controller, munge last (the others need it to exit cleanly)
[ -n "$SLURMDS$NODEP" ] && kill -TERM $SLURMDS $NODEP 2>/dev/null
[ -n "$CTLD$SCRD" ] && kill -TERM $CTLD $SCRD 2>/dev/null
for i in $(seq 50); do
  left=""; for p in $ALL; do [ "$p" != "$MUNGED" ] && alive "$p" && left="$left $p"; done
  [ -z "$left" ] && break; sleep 0.1
done
[ -n "$MUNGED" ] && kill -TERM $MUNGED 2>/dev/null
sleep 0.3
left=""; for p in $(echo $ALL $(ns_members "$NSL") | tr " " "\n" | sort -un); do alive "$p" && left="$left $p"; done
if [ -n "$left" ]; then echo "down: KILL$left"; kill -KILL $left 2>/dev/null; sleep 0.3; fi
rm -f "$RUN"/*.pid "$RUN"/*.uts "$RUN"/munge.socket "$RUN"/munge.socket.lock
echo "down: done"
