#!/bin/bash
# up.sh [N] -- bring up a throw-away Slurm 22.05 cluster of N emulated nodes (node1..nodeN)
# on this one machine and exit 0 once `srun -N N hostname` returns N distinct names.
# Adapted from the verified recipe in shared/slurm-lab; the project must not depend on it.
#  * munged with a private key and socket ($LAB/run/munge.socket)
#  * slurmctld on 127.0.0.1:$CTLD_PORT
#  * one slurmd per node (`slurmd -N nodeX`), node i at 127.0.0.$((10+i)):$((SLURMD_PORT_BASE+i)),
#    each in its own UTS+mount namespace (see node.sh). The network namespace is the host's,
#    so a job step reaches a server on the host's 127.0.0.1 directly.
# Env: LAB (/tmp/resild-slurm-lab), CPUS_PER_NODE (4), SLURMD_TIMEOUT (5), MSG_TIMEOUT (3),
#   CTLD_PORT (6917), SLURMD_PORT_BASE (17100), UP_TIMEOUT (120), LINK_ETC (1).
# Ports differ from the reference lab's (6817/17000) so both can run side by side.
# Exit codes: 0 up; 1 failed to come up; 2 usage; 3 prerequisites unavailable (not root,
#   no apt-get, package install failed, no unshare) -- callers may skip on 3.
set -euo pipefail
N=${1:-4}
LAB=${LAB:-/tmp/resild-slurm-lab}
CPUS=${CPUS_PER_NODE:-4}
SDT=${SLURMD_TIMEOUT:-5}
CTLD_PORT=${CTLD_PORT:-6917}
PORT_BASE=${SLURMD_PORT_BASE:-17100}
UP_TIMEOUT=${UP_TIMEOUT:-120}
HERE=$(cd "$(dirname "$0")" && pwd)
[[ $N =~ ^[0-9]+$ ]] && (( N >= 1 && N <= 200 )) || { echo "usage: $0 N (1..200)" >&2; exit 2; }
ms() { local t=${EPOCHREALTIME/./}; echo $(( t / 1000 )); }
T0=$(ms)
ts() { local d=$(( $(ms) - T0 )); printf '%d.%02ds' $((d/1000)) $(((d%1000)/10)); }
log() { echo "[up $(ts)] $*"; }
unavailable() { echo "up.sh: $*" >&2; exit 3; }

[ "$(id -u)" = 0 ] || unavailable "must run as root (slurmd/unshare/mount need it)"

# ---- 0. stop a previous instance started from this LAB (PID files only) ----
LAB=$LAB "$HERE/down.sh" >/dev/null 2>&1 || true

# ---- 1. packages ----
have_all() { command -v slurmctld && command -v slurmd && command -v srun && command -v munged; } >/dev/null
if ! have_all; then
  command -v apt-get >/dev/null || unavailable "Slurm not installed and no apt-get"
  log "installing slurmctld slurmd slurm-client munge"
  created_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then   # keep dpkg from starting the system munged/slurm*
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; created_policy=1
  fi
  mkdir -p "$LAB"; rc=0
  { timeout 300 apt-get -o DPkg::Lock::Timeout=120 update -qq &&
    DEBIAN_FRONTEND=noninteractive timeout 600 apt-get -o DPkg::Lock::Timeout=120 install -y -qq \
      --no-install-recommends slurmctld slurmd slurm-client munge; } >"$LAB/apt.log" 2>&1 || rc=$?
  [ $created_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
  have_all || unavailable "apt-get install slurmctld slurmd slurm-client munge failed (rc=$rc," \
                          "see $LAB/apt.log): $(tail -3 "$LAB/apt.log" | tr '\n' ' ')"
  log "packages installed"
fi
command -v unshare >/dev/null || unavailable "no unshare (util-linux)"

# ---- 2. directories, munge ----
rm -rf "$LAB/state" "$LAB/spool" "$LAB/run" "$LAB/log"
mkdir -p "$LAB"/{etc,state,spool,run,log,munge}
chmod 755 "$LAB/run"; chmod 700 "$LAB/munge"
[ -s "$LAB/munge/munge.key" ] || \
  { mungekey -c -k "$LAB/munge/munge.key" 2>/dev/null || dd if=/dev/urandom of="$LAB/munge/munge.key" bs=1024 count=1 status=none; }
chmod 400 "$LAB/munge/munge.key"
MSOCK=$LAB/run/munge.socket
munged --socket="$MSOCK" --key-file="$LAB/munge/munge.key" --pid-file="$LAB/run/munged.pid" \
       --log-file="$LAB/log/munged.log" --seed-file="$LAB/munge/munged.seed"
timeout 10 munge -S "$MSOCK" -n | timeout 10 unmunge -S "$MSOCK" >/dev/null
log "munged up (pid $(cat "$LAB/run/munged.pid"))"

# ---- 3. config ----
CTL=$(hostname -s)
CONF=$LAB/etc/slurm.conf
{
cat <<CFG
ClusterName=resildlab
SlurmctldHost=${CTL}(127.0.0.1)
SlurmctldPort=${CTLD_PORT}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${MSOCK}
StateSaveLocation=${LAB}/state
SlurmdSpoolDir=${LAB}/spool/%n
SlurmctldPidFile=${LAB}/run/slurmctld.pid
SlurmdPidFile=${LAB}/run/slurmd-%n.pid
SlurmctldLogFile=${LAB}/log/slurmctld.log
SlurmdLogFile=${LAB}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=${SDT}
SlurmctldTimeout=10
MessageTimeout=${MSG_TIMEOUT:-3}
InactiveLimit=0
MinJobAge=60
KillWait=2
Waittime=0
CFG
for i in $(seq 1 "$N"); do
  echo "NodeName=node$i NodeHostname=node$i NodeAddr=127.0.0.$((10+i)) Port=$((PORT_BASE+i)) CPUs=$CPUS RealMemory=1000 State=UNKNOWN"
done
echo "PartitionName=debug Nodes=node[1-$N] Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO"
} > "$CONF"
{ echo "127.0.0.1 localhost $CTL"
  for i in $(seq 1 "$N"); do echo "127.0.0.$((10+i)) node$i"; done; } > "$LAB/etc/hosts"
echo "export SLURM_CONF=$CONF" > "$LAB/env.sh"
export SLURM_CONF=$CONF
# A client run without SLURM_CONF would otherwise fall back to DNS SRV look-ups.
if [ "${LINK_ETC:-1}" = 1 ]; then
  if [ -e /etc/slurm/slurm.conf ] && [ ! -L /etc/slurm/slurm.conf ]; then
    log "NOT replacing existing regular file /etc/slurm/slurm.conf"
  else mkdir -p /etc/slurm; ln -sfn "$CONF" /etc/slurm/slurm.conf; fi
fi

# ---- 4. daemons ----
slurmctld -c -i            # daemonizes, writes run/slurmctld.pid
for i in $(seq 1 "$N"); do LAB=$LAB "$HERE/node.sh" start "node$i" >/dev/null; done
# remember slurmctld's helper (slurmscriptd) so down.sh can reap it by PID
for k in $(seq 50); do [ -s "$LAB/run/slurmctld.pid" ] && break; sleep 0.1; done
CPID=$(cat "$LAB/run/slurmctld.pid")
pgrep -P "$CPID" > "$LAB/run/slurmscriptd.pid" 2>/dev/null || true
log "daemons started (slurmctld $CPID, $N slurmd)"

# ---- 5. wait for N idle nodes, then srun -N N hostname ----
deadline=$(( $(date +%s) + UP_TIMEOUT ))
until [ "$(timeout 10 sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | wc -l)" -ge "$N" ]; do
  if [ "$(date +%s)" -ge "$deadline" ]; then
    echo "nodes not idle after ${UP_TIMEOUT}s" >&2; timeout 10 sinfo -N >&2 || true
    tail -5 "$LAB"/log/slurmctld.log >&2; exit 1; fi
  sleep 0.2
done
log "sinfo: $N nodes idle"
until out=$(timeout 30 srun -N "$N" -t 1 hostname 2>&1); do
  if [ "$(date +%s)" -ge "$deadline" ]; then echo "srun failed: $out" >&2; exit 1; fi
  sleep 0.5
done
got=$(echo "$out" | sort -u | wc -l)
[ "$got" -eq "$N" ] || { echo "expected $N distinct hostnames, got: $out" >&2; exit 1; }
log "srun -N $N hostname OK: $(echo $out | tr ' ' '\n' | sort -V | tr '\n' ' ')"
echo "source $LAB/env.sh   # sets SLURM_CONF"
