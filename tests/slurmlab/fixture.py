"""pytest helper around up.sh/down.sh/node.sh: a real Slurm cluster for the `slurm` tests.

Use from a conftest:

    @pytest.fixture(scope="session")
    def slurm_lab():
        with slurm_cluster(4) as lab:
            yield lab

Skips (rather than fails) when the lab cannot exist here: not root, or Slurm is missing and
cannot be installed. Set RESILD_REQUIRE_SLURM=1 (CI) to turn that skip into a failure.
RESILD_SLURM_LAB picks the lab directory (default /tmp/resild-slurm-lab).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
DEFAULT_LAB = "/tmp/resild-slurm-lab"
UP_TIMEOUT_S = 600  # includes a first-time apt-get install
DOWN_TIMEOUT_S = 60
CMD_TIMEOUT_S = 20
LOCK_WAIT_S = 300
EXIT_UNAVAILABLE = 3  # up.sh: prerequisites missing


@dataclass
class SlurmLab:
    lab: Path
    nodes: list[str]
    env: dict[str, str]  # os.environ minus any outer SLURM_*, plus this lab's SLURM_CONF
    up_seconds: float = 0.0
    _script_env: dict[str, str] = field(default_factory=dict, repr=False)

    # -- running Slurm commands ------------------------------------------------------------
    def run(
        self, args: Sequence[str], timeout: float = CMD_TIMEOUT_S, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this lab, always with a timeout."""
        res = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and res.returncode != 0:
            raise AssertionError(f"{' '.join(args)} -> {res.returncode}\n{res.stdout}{res.stderr}")
        return res

    def sbatch(self, args: Sequence[str], timeout: float = 60) -> tuple[str, str]:
        """Submit a batch job and poll until it ends; returns (job id, final JobState).

        Faster than `sbatch --wait`, whose poll interval grows to seconds."""
        jid = self.run(["sbatch", "--parsable", *args]).stdout.strip().split(";")[0]
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(jid)
            if state in _JOB_DONE:
                return jid, state
            if time.monotonic() > deadline:
                self.run(["scancel", jid], check=False)
                raise AssertionError(f"job {jid} still {state} after {timeout}s")
            time.sleep(0.1)

    def job_state(self, jid: str) -> str:
        out = self.run(["scontrol", "show", "job", "-o", jid]).stdout
        m = re.search(r"\bJobState=(\S+)", out)
        if not m:
            raise AssertionError(f"no JobState for job {jid}: {out!r}")
        return m.group(1)

    def _node_sh(self, action: str, node: str) -> str:
        if node not in self.nodes:
            raise ValueError(f"{node!r} is not a lab node {self.nodes}")
        res = subprocess.run(
            [str(HERE / "node.sh"), action, node], env=self._script_env, capture_output=True, text=True, timeout=30
        )
        if res.returncode != 0:
            raise AssertionError(f"node.sh {action} {node} -> {res.returncode}: {res.stderr}")
        return res.stdout

    # -- failure injection ----------------------------------------------------------------
    def crash(self, node: str) -> str:
        """SIGKILL slurmd, slurmstepd and the tasks of `node`; returns node.sh's line (the pids)."""
        return self._node_sh("crash", node)

    def freeze(self, node: str) -> None:
        """SIGSTOP every process of `node` (a hung node)."""
        self._node_sh("freeze", node)

    def thaw(self, node: str) -> None:
        self._node_sh("thaw", node)

    def pids(self, node: str) -> list[int]:
        """The node's live processes: node.sh's rule (UTS namespace recorded by `start`, never the
        host's; zombies left out), read from /proc in this process. node.sh forks per process and
        takes seconds on a loaded machine, too slow to time how fast processes go away."""
        if node not in self.nodes:
            raise ValueError(f"{node!r} is not a lab node {self.nodes}")
        try:
            ns = set((self.lab / "run" / f"{node}.uts").read_text().split())
        except OSError:
            return []
        with contextlib.suppress(OSError):  # /proc/1 may be unreadable in a container
            ns.discard(os.readlink("/proc/1/ns/uts"))
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                if os.readlink(f"/proc/{d}/ns/uts") not in ns:
                    continue
                with open(f"/proc/{d}/stat") as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue  # gone meanwhile
            if state != "Z":
                out.append(int(d))
        return sorted(out)

    def start(self, node: str, wait_s: float = 15) -> None:
        """(Re)start the node's slurmd and wait until slurmctld hears from it."""
        self._node_sh("start", node)
        self.wait_state(node, lambda s: not s.endswith("*") and s != "unknown", wait_s)

    # -- node state -----------------------------------------------------------------------
    def node_state(self, node: str) -> str:
        """sinfo's long state, e.g. 'idle', 'drained', 'down*' ('*' = not responding)."""
        return self.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"]).stdout.strip()

    def wait_state(self, node: str, ok: Callable[[str], bool], wait_s: float) -> str:
        deadline = time.monotonic() + wait_s
        while True:
            state = self.node_state(node)
            if ok(state):
                return state
            if time.monotonic() > deadline:
                raise AssertionError(f"{node} still {state!r} after {wait_s}s")
            time.sleep(0.1)

    def sinfo_reasons(self) -> dict[str, str]:
        """{node: reason} for every drained/down node (`sinfo -R`, one line per node)."""
        out = self.run(["sinfo", "-R", "-N", "-h", "-o", "%N|%E"]).stdout
        return dict(line.split("|", 1) for line in out.splitlines() if "|" in line)

    def resume(self, node: str, wait_s: float = 15) -> None:
        """scontrol update State=RESUME, then wait until the node is usable again
        (right after RESUME slurmctld shows it not-responding until its next ping)."""
        self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"])
        self.wait_state(node, _usable, wait_s)

    def restore(self, node: str, wait_s: float = 20) -> None:
        """Bring a crashed/frozen/drained node back to a usable state."""
        self.thaw(node)
        self.start(node, wait_s)
        state = self.node_state(node)
        if "drain" in state or state.startswith("down"):
            self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
        try:
            self.wait_state(node, _usable, wait_s)
        except AssertionError:
            # A node crashed under a job can stay 'completing' for long: DOWN then RESUME clears it.
            self.run(["scontrol", "update", f"NodeName={node}", "State=DOWN", "Reason=lab restore"], check=False)
            self.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"], check=False)
            self.wait_state(node, _usable, wait_s)


_JOB_DONE = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}
)


def _usable(state: str) -> bool:
    # not "completing": that node still waits for its slurmd to confirm a job's end
    return state in {"idle", "mixed", "allocated"}


def _clean_env(lab: Path) -> dict[str, str]:
    # An outer Slurm job's SLURM_* (e.g. pytest itself run under srun) would point our
    # srun/sbatch at the wrong job or cluster.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SLURMD_"))}
    env["SLURM_CONF"] = str(lab / "etc" / "slurm.conf")
    return env


def _unavailable(reason: str) -> None:
    if os.environ.get("RESILD_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm lab required (RESILD_REQUIRE_SLURM=1) but unavailable: {reason}")
    pytest.skip(f"Slurm lab unavailable: {reason}")


@contextlib.contextmanager
def _lab_lock(lab: Path) -> Iterator[None]:
    """One pytest session per lab dir: up.sh would otherwise tear down another session's lab."""
    lab.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{lab}.lock", "w") as fh:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"{lab}.lock held by another session for {LOCK_WAIT_S}s")
                time.sleep(0.5)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def slurm_cluster(n_nodes: int, lab: str | os.PathLike[str] | None = None) -> Iterator[SlurmLab]:
    """Bring up an `n_nodes` lab with up.sh, yield it, and always run down.sh afterwards."""
    if os.geteuid() != 0:
        _unavailable("needs root (slurmd, unshare and mount run as root)")
    if shutil.which("slurmctld") is None and shutil.which("apt-get") is None:
        _unavailable("Slurm is not installed and apt-get is not available to install it")
    lab_dir = Path(lab or os.environ.get("RESILD_SLURM_LAB") or DEFAULT_LAB)
    script_env = {**_clean_env(lab_dir), "LAB": str(lab_dir)}
    with _lab_lock(lab_dir):
        t0 = time.monotonic()
        try:
            res = subprocess.run(
                [str(HERE / "up.sh"), str(n_nodes)],
                env=script_env,
                capture_output=True,
                text=True,
                timeout=UP_TIMEOUT_S,
            )
        except subprocess.TimeoutExpired:
            _down(script_env)
            pytest.fail(f"up.sh {n_nodes} timed out after {UP_TIMEOUT_S}s")
        if res.returncode == EXIT_UNAVAILABLE:
            _down(script_env)
            _unavailable(res.stderr.strip())
        if res.returncode != 0:
            _down(script_env)
            pytest.fail(f"up.sh {n_nodes} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
        cluster = SlurmLab(
            lab=lab_dir,
            nodes=[f"node{i}" for i in range(1, n_nodes + 1)],
            env=_clean_env(lab_dir),
            up_seconds=time.monotonic() - t0,
            _script_env=script_env,
        )
        try:
            yield cluster
        finally:
            _down(script_env)


def _down(script_env: dict[str, str]) -> None:
    subprocess.run([str(HERE / "down.sh")], env=script_env, capture_output=True, timeout=DOWN_TIMEOUT_S)
