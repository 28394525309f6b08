#!/bin/bash
# node.sh ACTION nodeX -- failure injection for one emulated node of the up.sh lab
#   crash  : SIGKILL every process of the node (slurmd + slurmstepd + job tasks)
#   stop   : SIGTERM only the node's slurmd (job tasks keep running, like a dead daemon)
#   freeze : SIGSTOP every process of the node (a hung node); thaw: SIGCONT
#   start  : (re)start slurmd for the node in a fresh UTS+mount namespace
#   pids   : list the node's live processes
# A node's processes are found by UTS namespace (recorded in $LAB/run/nodeX.uts by start),
# never by name, so nothing outside the lab is touched. The kernel reuses a freed namespace's
# inode number at once, so start drops dead namespaces from every node's list before it claims
# the new one: otherwise crashing node1 would also kill a node restarted into node1's old number.
set -u
LAB=${LAB:-/tmp/resild-slurm-lab}; RUN=$LAB/run
export SLURM_CONF=$LAB/etc/slurm.conf
act=${1:?action}; node=${2:?node}
[[ $node =~ ^node[0-9]+$ ]] || { echo "bad node $node" >&2; exit 2; }
HOST_UTS=$(readlink /proc/1/ns/uts)
alive() { [ -r "/proc/$1/stat" ] && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }
members() {
  local nsl p ns
  nsl=$(grep -v -xF "$HOST_UTS" "$RUN/$node.uts" 2>/dev/null) || return 0
  for p in /proc/[0-9]*; do p=${p#/proc/}
    ns=$(readlink "/proc/$p/ns/uts" 2>/dev/null) || continue
    [ "$ns" != "$HOST_UTS" ] && grep -qxF "$ns" <<<"$nsl" && alive "$p" && echo "$p"
  done
}
claim_ns() { # $1: the uts namespace of this node's new slurmd; under a lock (starts may overlap)
  local live f
  exec 9>"$RUN/uts.lock"; flock 9
  live=$(for p in /proc/[0-9]*; do readlink "$p/ns/uts" 2>/dev/null; done | sort -u)
  for f in "$RUN"/node*.uts; do
    [ -e "$f" ] || continue
    { grep -vxF "$1" "$f" | grep -xF -f <(echo "$live") || true; } > "$f.tmp" && mv "$f.tmp" "$f"
  done
  echo "$1" >> "$RUN/$node.uts"
  flock -u 9
}
slurmd_pid() { # live slurmd pid of this node, if any
  local p; p=$(cat "$RUN/slurmd-$node.pid" 2>/dev/null) || return 0
  [[ $p =~ ^[0-9]+$ ]] && alive "$p" && [ "$(cat /proc/$p/comm 2>/dev/null)" = slurmd ] && echo "$p"
  return 0
}
case $act in
  pids)   members | tr '\n' ' '; echo ;;
  crash)  # all at once, like a host losing power: stop every process (again for any forked
          # meanwhile), then kill. One by one, a survivor acts on a sibling's death: srun's helper
          # process had slurmstepd kill the step's tasks on the other nodes.
          p=""; for k in 1 2 3 4 5; do n=$(members | grep -vxF -f <(printf '%s\n' $p 0) || true)
            [ -z "$n" ] && break; kill -STOP $n 2>/dev/null; p="$p $n"; done
          [ -n "$p" ] && kill -KILL $p 2>/dev/null; echo "crashed $node:" $p ;;
  freeze) p=$(members); [ -n "$p" ] && kill -STOP $p; echo "froze $node:" $p ;;
  thaw)   p=$(members); [ -n "$p" ] && kill -CONT $p; echo "thawed $node:" $p ;;
  stop)   p=$(slurmd_pid); [ -n "$p" ] && kill -TERM "$p"; echo "stopped slurmd $node:" $p ;;
  start)
    p=$(slurmd_pid)
    if [ -n "$p" ]; then echo "$node slurmd already running ($p)"; exit 0; fi
    rm -f "$RUN/slurmd-$node.pid"; mkdir -p "$LAB/spool/$node"
    # own UTS (hostname) + mount ns (private /etc/hosts); slurmd daemonizes inside it
    unshare --uts --mount --propagation private sh -c \
      "mount --bind '$LAB/etc/hosts' /etc/hosts && hostname $node && exec slurmd -N $node" ||
      { echo "slurmd $node failed to start" >&2; exit 1; }
    for k in $(seq 300); do [ -s "$RUN/slurmd-$node.pid" ] && break; sleep 0.05; done  # 15 s: slow under load
    p=$(slurmd_pid)
    [ -n "$p" ] || { echo "slurmd $node wrote no pid file" >&2; exit 1; }
    ns=$(readlink "/proc/$p/ns/uts") || { echo "slurmd $node ($p) has no uts namespace" >&2; exit 1; }
    claim_ns "$ns"
    echo "started $node slurmd $p" ;;
  *) echo "unknown action $act" >&2; exit 2 ;;
esac
