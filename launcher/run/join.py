"""`resil-run --join RUN_DIR`: nodes that join a running job as hot spares.

The job writes `RUN_DIR/join.json` (0600: the job id, the controller's address, what a
node runs) and its join key `RUN_DIR/keys/join/` (the job secret: a CURVE pair only the
job's user can read). A joiner proves it holds the key by the CURVE handshake, names the
job it read, and asks for its nodes; the controller journals the admission, mints each
node's own key and answers ADMIT. The nodes then start as any spare does: they register,
their workers warm up and wait. A refusal is one line on both sides, and exit code 2.

    JOIN {job, nodes}  ->  ADMIT {job, nodes, keys}  |  ERROR {code: "refused", detail}
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import resild.wire.env as resild_env
from launcher.node.command import node_command
from resild.procutil import say
from resild.wire.keys import JOINER, KeyDir
from resild.wire.protocol import MsgType

JOIN_FILE = "join.json"
JOIN_VERSION = 1
JOIN_TIMEOUT_S = 10.0  # for the controller's answer: it answers at once when it runs
JOIN_EXIT = 2  # refused, or nothing to join: the joiner's mistake, said in one line


class JoinError(Exception):
    """Why nodes cannot join: one line for the user (exit JOIN_EXIT)."""


@dataclass(frozen=True)
class JoinInfo:
    """What a joining node needs to know of the job, and whether it is over."""

    job: str
    endpoint: str
    nproc: int
    cmd: list[str]
    settings: dict[str, Any] = field(default_factory=dict)
    fake_nvml: str | None = None  # the NVML stand-in's library dir (--local only)
    ended: bool = False
    exit_code: int | None = None
    v: int = JOIN_VERSION

    def write(self, run_dir: Path) -> None:
        """Atomically, readable by the job's user only (it names the job's address)."""
        tmp = run_dir / f".{JOIN_FILE}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(self), f)
        os.replace(tmp, run_dir / JOIN_FILE)

    @classmethod
    def read(cls, run_dir: Path) -> JoinInfo:
        p = run_dir / JOIN_FILE
        if not run_dir.is_dir():
            raise JoinError(f"{run_dir} is not a directory")
        try:
            raw = json.loads(p.read_text())
        except FileNotFoundError:
            raise JoinError(
                f"{run_dir} is not the run directory of a job that takes joining nodes (no {JOIN_FILE})"
            ) from None
        except (OSError, ValueError) as e:
            raise JoinError(f"cannot read {p}: {e}") from None
        if not isinstance(raw, dict) or raw.get("v") != JOIN_VERSION:
            raise JoinError(
                f"{p} is version {raw.get('v') if isinstance(raw, dict) else '?'}; this resil-run reads {JOIN_VERSION}"
            )
        try:
            return cls(
                job=str(raw["job"]),
                endpoint=str(raw["endpoint"]),
                nproc=int(raw["nproc"]),
                cmd=[str(c) for c in raw["cmd"]],
                settings=dict(raw.get("settings") or {}),
                fake_nvml=raw.get("fake_nvml"),
                ended=bool(raw.get("ended")),
                exit_code=raw.get("exit_code"),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise JoinError(f"{p} is malformed: {e!r}") from None


def mark_ended(run_dir: Path, exit_code: int) -> None:
    """The job is over: a joiner that comes later is told so, in one line."""
    try:
        info = JoinInfo.read(run_dir)
        JoinInfo(**{**asdict(info), "ended": True, "exit_code": exit_code}).write(run_dir)
    except (JoinError, OSError):
        pass  # no join file (or a full disk): a late joiner finds no controller instead


def ask(
    run_dir: Path, info: JoinInfo, names: list[str], timeout_s: float = JOIN_TIMEOUT_S, source: str = "local"
) -> list[str]:
    """Ask the job's controller to admit `names` as spares; their names, or JoinError."""
    import zmq

    from resild.wire.channel import connect

    keys = KeyDir(run_dir / "keys" / JOINER)
    if not (keys.path / "client.key_secret").exists():
        raise JoinError(f"no join key in {keys.path} (the job secret): is {run_dir} the job's run directory?")
    ctx = zmq.Context()
    try:
        ch = connect(ctx, info.endpoint, keys, sender=f"{JOINER}/{os.getpid()}")
        # A controller that refuses our key says nothing: the handshake's failure is how we know.
        assert ch.monitor is not None  # a DEALER's connection events
        poller = zmq.Poller()
        poller.register(ch.sock, zmq.POLLIN)
        poller.register(ch.monitor, zmq.POLLIN)
        ch.send(MsgType.JOIN, {"job": info.job, "nodes": names, "source": source}, ttl_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000) + 1))
            ch.link_events()
            if ch.handshake_failed is not None:
                raise JoinError(
                    f"the controller of job {info.job} refused the join key "
                    f"({'authentication' if ch.handshake_failed == zmq.EVENT_HANDSHAKE_FAILED_AUTH else 'handshake'}"
                    " failed): "
                    f"{keys.path} is not this job's"
                )
            got = ch.recv(0) if ch.sock in ready else None
            if got is None:
                continue
            msg = got[1]
            if msg.type is MsgType.ADMIT:
                return [str(n) for n in msg.body.get("nodes") or []]
            if msg.type is MsgType.ERROR:
                raise JoinError(f"job {info.job} refused: {msg.body.get('detail')}")
        raise JoinError(
            f"no controller answered at {info.endpoint} within {timeout_s:g}s: job {info.job} is not running "
            f"(a stale run directory?), or {keys.path} does not hold its keys"
        )
    finally:
        ctx.destroy(linger=0)


def _check_open(run_dir: Path) -> JoinInfo:
    from resild.controller.verdict_file import RESULT_FILE

    info = JoinInfo.read(run_dir)
    if info.ended or (run_dir / RESULT_FILE).exists():
        raise JoinError(f"job {info.job} of {run_dir} has ended (exit code {info.exit_code}): nothing to join")
    return info


def _supervise(proc_alive: Callable[[], bool], stop_all: Callable[[], object], what: str) -> int | None:
    """Wait while `proc_alive()`; on SIGINT/SIGTERM call `stop_all()` and return 128+signal."""
    stop: list[int] = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: stop.append(s))
    while not stop and proc_alive():
        time.sleep(0.2)
    if stop:
        stop_all()
        say(f"resil-run: {what} stopped by signal {stop[0]}")
        return 128 + stop[0]
    return None


def run_join_slurm(run_dir: Path, timeout_s: float = JOIN_TIMEOUT_S) -> int:
    """--join inside a Slurm allocation (a cold-spare job, e.g. `sbatch --array`): every node
    of this allocation joins the job of RUN_DIR (on the shared file system) as a spare, one
    node process per node in one `srun` step, each qualifying before it registers. When the
    job ends they are told to shut down; if its controller is lost, each cancels this
    allocation (never requeues it: a cold spare must not outlive the job)."""
    import subprocess

    from launcher.run.slurm_backend import per_node_keys
    from resild import slurm

    alloc = slurm.allocation_from_env(os.environ)
    if alloc is None:
        raise JoinError("not inside a Slurm allocation (no SLURM_JOB_ID): use --local for simulated nodes")
    info = _check_open(run_dir)
    admitted = ask(run_dir, info, list(alloc.nodes), timeout_s, source=f"slurm:{alloc.job_id}")
    say(f"resil-run: {', '.join(admitted)} (Slurm job {alloc.job_id}) joined job {info.job} as hot spares")
    node_cmd = node_command(
        info.endpoint, info.nproc, info.settings, info.cmd, keys=(run_dir / "keys").resolve(), qualify=True
    )
    argv = slurm.srun_node_launcher_cmd(alloc, admitted, per_node_keys(node_cmd, admitted, mint=False))
    env = {**os.environ, resild_env.ON_CONTROLLER_LOST.name: "cancel"}
    p = subprocess.Popen(argv, env=env, start_new_session=True)

    def stop_all() -> None:
        os.killpg(p.pid, signal.SIGTERM)  # srun passes it to the step's tasks
        try:
            p.wait(15.0)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()

    code = _supervise(lambda: p.poll() is None, stop_all, "joined nodes")
    if code is not None:
        return code
    if p.returncode != 0:
        say(f"resil-run: the joined nodes' srun ended with code {p.returncode}")
    return 0 if p.returncode == 0 else 1


def run_join(run_dir: Path, nodes: int, timeout_s: float = JOIN_TIMEOUT_S) -> int:
    """--local --join: `nodes` simulated nodes on this machine join the job as spares and
    run until the job ends (or they are fenced). Returns the exit code."""
    from launcher.run.local import LocalCluster
    from resild.wire.settings import JobSettings

    info = _check_open(run_dir)
    names = [f"local-join{os.getpid()}-{i}" for i in range(nodes)]
    admitted = ask(run_dir, info, names, timeout_s)
    say(f"resil-run: {', '.join(admitted)} joined job {info.job} as hot spares")
    backend = LocalCluster(
        admitted,
        info.nproc,
        info.cmd,
        run_dir,
        Path(info.fake_nvml) if info.fake_nvml else None,
        settings=JobSettings.from_dict(info.settings),
        qualify=True,
    )
    backend.start(info.endpoint, run_dir / "keys", minted=True)
    try:
        code = _supervise(lambda: any(p.poll() is None for p in backend.procs.values()), lambda: None, "joined nodes")
    except BaseException:
        backend.shutdown(0.0)
        raise
    backend.shutdown(0.0 if code is not None else 5.0)
    if code is not None:
        return code
    codes = {n: p.returncode for n, p in backend.procs.items()}
    bad = {n: c for n, c in codes.items() if c != 0}
    for n, c in bad.items():
        say(f"resil-run: joined node {n} ended with code {c}")
    return 1 if bad else 0
