"""Every RESILD_* environment variable: its name, who reads it, its default, what it means.

Environment variables are an interface between processes (the node process tells its
workers where things are) and between a user and a process; this module is their one
list. The README's table is checked against it (tests/resild/wire/test_env.py), and so is
every RESILD_* name in the code. The node daemon's configuration keys have their own
prefix, RESILD_CFG_<KEY> (`resild.health.config`), so a variable the node process sets
for its workers can never be read as daemon configuration.

    python -m resild.wire.env          # the table, as the README shows it
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EnvVar:
    name: str
    reader: str  # the process that reads it
    default: str  # "" when unset means "not given"
    meaning: str
    set_by: str = "you"  # who sets it: "you" (a user or site), or the process that does


CONTROLLER = EnvVar(
    "RESILD_CONTROLLER", "worker", "", "the controller endpoints (comma-separated, leader first)", "node process"
)
NODE = EnvVar("RESILD_NODE", "worker", "solo", "this node's name", "node process")
NPROC = EnvVar("RESILD_NPROC", "worker", "", "ranks (workers) on this node", "node process")
LOCAL_RANK = EnvVar("RESILD_LOCAL_RANK", "worker", "0", "this worker's rank on its node", "node process")
KEYS = EnvVar("RESILD_KEYS", "worker", "", "this node's CURVE key directory (only its own secret key)", "node process")
RELAY = EnvVar("RESILD_RELAY", "worker", "", "the node-local relay's ipc:// endpoint", "node process")
BACKEND = EnvVar("RESILD_BACKEND", "worker", "nccl with CUDA, else gloo", "the torch.distributed backend")
GLOO_HOST = EnvVar(
    "RESILD_GLOO_HOST",
    "worker",
    "127.0.0.1 under `--local`, else the host's name",
    "the address gloo binds and advertises",
)
SPARE_WARMUP = EnvVar(
    "RESILD_SPARE_WARMUP",
    "worker",
    "1",
    "0: a waiting spare does not warm up for the job's sharded state (comparisons, bench/sharded.py)",
)
SPARE_PREPARE = EnvVar(
    "RESILD_SPARE_PREPARE",
    "worker",
    "1",
    "0: a waiting spare does not run the script's `launcher.init(prepare=...)` (comparisons, bench/compiled_spare.py)",
)
CHECK_COLLECTIVES = EnvVar(
    "RESILD_CHECK_COLLECTIVES",
    "worker",
    "0",
    "1: before every collective, ranks compare what they issue, and the first difference stops the job in "
    "one line (debug mode; launcher/worker/collective_check.py)",
)
DIVERGENCE_ROLLBACK = EnvVar(
    "RESILD_DIVERGENCE_ROLLBACK",
    "worker",
    "1",
    "0: with --fingerprint-every, keep no host copy of the last agreed state (a rank's state in size); a "
    "divergence found after it spread then leaves state resild cannot vouch for (said in the summary)",
)
CHECKPOINT_FAULTS = EnvVar(
    "RESILD_CHECKPOINT_FAULTS",
    "worker",
    "",
    "tests and drills: disk checkpoint faults, POINT:MODE@STEP[:rRANK], e.g. write:hang@20:r1 "
    "(launcher/worker/redundancy/checkpoint_faults.py)",
)
ABORT_DELAY_S = EnvVar(
    "RESILD_ABORT_DELAY_S",
    "worker",
    "0",
    "tests and drills: seconds added to every failed epoch's communicator abort, as NCCL's takes ~1 s; "
    "'S:fenced' also fences gloo's, as a GPU recovery waits (launcher/worker/old_backends.py)",
)
LOCAL_NVML = EnvVar(
    "RESILD_LOCAL_NVML",
    "resil-run",
    "",
    "tests and drills, --local: lines added to each simulated node's NVML stand-in state, ';' between them, "
    "e.g. 'set 0 remap_pending 1' (resild/health/fake_nvml.c)",
)
AGENT_SOCKET = EnvVar(
    "RESILD_AGENT_SOCKET", "worker", "/run/resild/status.sock if present", "the node daemon's socket to register with"
)
DAEMON_SOCKET = EnvVar(
    "RESILD_DAEMON_SOCKET",
    "node process",
    "the config's status_socket",
    "the node daemon whose health verdict the node process follows",
)
EXIT_GRACE_S = EnvVar(
    "RESILD_EXIT_GRACE_S", "node process", "600", "seconds workers get to finish (final save) after a successful job"
)
ON_CONTROLLER_LOST = EnvVar(
    "RESILD_ON_CONTROLLER_LOST",
    "node process",
    "requeue",
    "under Slurm, what a node whose lease ran out does with the job: requeue, cancel or none",
)
CONTROLLER_HOST = EnvVar(
    "RESILD_CONTROLLER_HOST",
    "resil-run, controller replica",
    "the host's FQDN",
    "the address nodes use to reach the controller (Slurm)",
)
DEBUG = EnvVar("RESILD_DEBUG", "controller replica", "", "any value: log at INFO level")
CONFIG = EnvVar(
    "RESILD_CONFIG", "node daemon, node process", "/etc/resild/resild.toml", "the daemon's TOML configuration file"
)
CFG_PREFIX = "RESILD_CFG_"
CFG = EnvVar(
    CFG_PREFIX + "<KEY>",
    "node daemon, node process",
    "the config file's value",
    "one daemon configuration key, e.g. RESILD_CFG_PROBE_INTERVAL_S=2 (overrides the file)",
)
REQUIRE_SLURM = EnvVar(
    "RESILD_REQUIRE_SLURM", "test suite", "", "1: the Slurm lab must come up (CI), never skip its tests", ".ci/run"
)

REGISTRY: tuple[EnvVar, ...] = (
    CONTROLLER,
    NODE,
    NPROC,
    LOCAL_RANK,
    KEYS,
    RELAY,
    BACKEND,
    GLOO_HOST,
    SPARE_WARMUP,
    SPARE_PREPARE,
    CHECK_COLLECTIVES,
    DIVERGENCE_ROLLBACK,
    CHECKPOINT_FAULTS,
    ABORT_DELAY_S,
    LOCAL_NVML,
    AGENT_SOCKET,
    DAEMON_SOCKET,
    EXIT_GRACE_S,
    ON_CONTROLLER_LOST,
    CONTROLLER_HOST,
    DEBUG,
    CONFIG,
    CFG,
    REQUIRE_SLURM,
)


def markdown_table() -> str:
    rows = ["| variable | read by | set by | default | meaning |", "|---|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.reader} | {v.set_by} | {v.default or '-'} | {v.meaning} |" for v in REGISTRY]
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
