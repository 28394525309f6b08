#!/bin/bash
# slurm_baseline_job.sh -- the baseline for bench/slurm_recovery.py: plain `srun` + a disk
# checkpoint + a hand-written restart loop, i.e. what a careful user does today without resild.
#
#   sbatch -o WORK/slurm.out bench/slurm_baseline_job.sh WORK [STEPS] [CKPT_EVERY]
#
# (submit from the repository root, or set RESILD_REPO). The job holds 3 nodes (--no-kill, so
# losing one does not end the allocation) and trains on ACTIVE_NODES (2) of them, one rank per
# node, with bench/baseline_train.py (same model/data as examples/train.py, checkpoint every
# CKPT_EVERY steps into WORK/ckpt.pt). When srun exits non-zero -- a node crashed -- the script
# polls sinfo until it sees which node(s) of the allocation are down/drained/not responding,
# then runs srun again (with --overlap, see below) on ACTIVE_NODES nodes excluding them (the third
# node is the spare); the workers resume from the checkpoint. Every srun is under `timeout`.
#
# Output: the workers append their events to WORK/events.jsonl (TORCHELASTIC_RESTART_COUNT is
# set to the attempt number, so `restart_count` in each event is the attempt); this script
# appends its own events (job_started, task, task_exit, srun_start, srun_exit, failed_nodes,
# gave_up),
# each with t_wall (seconds since the epoch), to WORK/job_events.jsonl.
#
# Env: PYTHON (REPO/.venv/bin/python), ACTIVE_NODES (2), MAX_ATTEMPTS (3), SRUN_TIMEOUT (300 s
# per srun), FIND_FAILED_TIMEOUT (60 s to see the failed node in sinfo), PG_TIMEOUT (60 s, gloo).
#SBATCH -N 3
#SBATCH --exclusive
#SBATCH --no-kill
#SBATCH -t 10
set -u
WORK=${1:?usage: slurm_baseline_job.sh WORKDIR [STEPS] [CKPT_EVERY]}
STEPS=${2:-400}
CKPT_EVERY=${3:-50}
ACTIVE=${ACTIVE_NODES:-2}
MAX_ATTEMPTS=${MAX_ATTEMPTS:-3}
REPO=${RESILD_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}
PY=${PYTHON:-$REPO/.venv/bin/python}
LOG=$WORK/job_events.jsonl
export JOB_EVENTS=$LOG   # the task wrapper below appends here too
cd "$REPO" || exit 2

# one short line per event, appended with a single write (O_APPEND): lines never interleave
jev() { echo "{\"event\":\"$1\",\"t_wall\":$EPOCHREALTIME${2:+,$2}}" >> "$LOG"; }
# bad nodes of this allocation: sinfo's state says down/drain/fail or ends in '*' (not responding)
failed_nodes() {
  sinfo -h -N -n "$SLURM_JOB_NODELIST" -o '%N %T' 2>/dev/null |
    awk '$2 ~ /\*$|down|drain|fail/ {print $1}' | sort -u | paste -sd, -
}

jev job_started "\"batch_host\":\"$(hostname)\",\"job_id\":$SLURM_JOB_ID,\"nodelist\":\"$SLURM_JOB_NODELIST\""
exclude=""
attempt=0
while :; do
  port=$(( 20000 + (SLURM_JOB_ID % 400) * 25 + attempt ))   # a fresh rendezvous port per attempt
  jev srun_start "\"attempt\":$attempt,\"exclude\":\"$exclude\",\"port\":$port"
  # The task wrapper maps Slurm's task ids onto the torchrun-style env baseline_train.py reads.
  # --overlap on the restarts: the crashed step never finishes (its dead node cannot confirm;
  # slurmctld logs "unable to update job's core use information due to job resizing"), so it keeps
  # the survivor's CPUs and a plain srun waits forever in "step creation temporarily disabled
  # (Requested nodes are busy)".
  overlap=""; [ "$attempt" -gt 0 ] && overlap=--overlap
  timeout "${SRUN_TIMEOUT:-300}" srun -N "$ACTIVE" --ntasks-per-node=1 --kill-on-bad-exit=1 $overlap \
      ${exclude:+--exclude="$exclude"} \
      env MASTER_ADDR=127.0.0.1 MASTER_PORT=$port TORCHELASTIC_RESTART_COUNT=$attempt OMP_NUM_THREADS=1 \
      bash -c 'export RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS LOCAL_RANK=0
        echo "{\"event\":\"task\",\"t_wall\":$EPOCHREALTIME,\"attempt\":$TORCHELASTIC_RESTART_COUNT,\"rank\":$RANK,\"node\":\"$SLURMD_NODENAME\"}" >> "$JOB_EVENTS"
        "$0" "$@"; rc=$?
        echo "{\"event\":\"task_exit\",\"t_wall\":$EPOCHREALTIME,\"attempt\":$TORCHELASTIC_RESTART_COUNT,\"rank\":$RANK,\"node\":\"$SLURMD_NODENAME\",\"rc\":$rc}" >> "$JOB_EVENTS"
        exit $rc' \
      "$PY" bench/baseline_train.py --steps "$STEPS" --ckpt "$WORK/ckpt.pt" --ckpt-every "$CKPT_EVERY" \
      --events "$WORK/events.jsonl" --pg-timeout "${PG_TIMEOUT:-60}"
  rc=$?
  jev srun_exit "\"attempt\":$attempt,\"rc\":$rc"
  [ "$rc" = 0 ] && exit 0
  attempt=$((attempt + 1))
  if [ "$attempt" -ge "$MAX_ATTEMPTS" ]; then jev gave_up "\"rc\":$rc"; exit "$rc"; fi
  # Which node went away? Poll until slurmctld says so (it needs SlurmdTimeout to notice).
  deadline=$(( $(date +%s) + ${FIND_FAILED_TIMEOUT:-60} ))
  bad=$(failed_nodes)
  while [ -z "$bad" ] && [ "$(date +%s)" -lt "$deadline" ]; do sleep 0.2; bad=$(failed_nodes); done
  exclude=$(echo "$exclude,$bad" | tr ',' '\n' | grep -v '^$' | sort -u | paste -sd, -)
  jev failed_nodes "\"attempt\":$attempt,\"nodes\":\"$bad\",\"exclude\":\"$exclude\""
done
