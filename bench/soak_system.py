"""Faults of the control plane for the whole-system soak (`bench/soak.py --system`):
actions the harness takes on a running `resil-run --controllers 3` job, at a committed
step it reads from the job's events file, while the job's own node faults (`--inject`)
fire as usual.

    leaderkill@S          SIGKILL the leading controller replica
    stall:leader@S+T      SIGSTOP the leader for T seconds (it is deposed meanwhile and
                          must come back as a standby, never speak for the job again)
    stall:standby@S+T     SIGSTOP one standby replica for T seconds
    diskfull@S            fill the run directory's file system (a tmpfs mounted for the
                          run: journals, replica logs, the replicated log's data) and keep
                          it full to the end
    flood:NODE@S          with NODE's key, 300 one-megabyte EVENTs to the leader (the
                          controller must keep every lease on time; the flooder may be
                          fenced as abusive, never its victims)

Every action is recorded with its time, and every stopped process is continued when the
run ends, whatever happened.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

KINDS = ("leaderkill", "stall", "diskfull", "flood")
_SPEC = re.compile(r"^(?P<kind>[a-z]+)(?::(?P<target>[\w-]+))?@(?P<step>\d+)(?:\+(?P<secs>[\d.]+))?$")
TMPFS_SIZE = "1g"  # etcd preallocates 64 MB of WAL per member: room for the job, then filled


@dataclass(frozen=True)
class SystemFault:
    kind: str
    at_step: int
    target: str = ""  # stall: leader | standby; flood: the node whose key floods
    seconds: float = 0.0  # stall: how long

    @classmethod
    def parse(cls, spec: str) -> SystemFault:
        m = _SPEC.match(spec)
        if m is None or m["kind"] not in KINDS:
            raise ValueError(f"not a system fault: {spec!r} (e.g. leaderkill@20, stall:standby@15+3, flood:node0@10)")
        kind, target = m["kind"], m["target"] or ""
        if kind == "stall" and (target not in ("leader", "standby") or not m["secs"]):
            raise ValueError(f"{spec!r}: stall:leader@S+T or stall:standby@S+T")
        if kind == "flood" and not target:
            raise ValueError(f"{spec!r}: flood:NODE@S")
        return cls(kind, int(m["step"]), target, float(m["secs"] or 0))

    def __str__(self) -> str:
        t = f":{self.target}" if self.target else ""
        s = f"+{self.seconds:g}" if self.seconds else ""
        return f"{self.kind}{t}@{self.at_step}{s}"


@dataclass
class Fired:
    fault: str
    t_mono: float
    what: str


@dataclass
class SystemFaults:
    """Follows the events file; fires each fault once its step is committed."""

    faults: list[SystemFault]
    events: Path
    run_dir: Path
    mark: str  # the RESILD_SOAK_MARK of this run's processes
    node_prefix: str = "local-"
    fired: list[Fired] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _step: int = 0
    _leader: dict[str, Any] | None = None
    _offset: int = 0
    _stopped: list[psutil.Process] = field(default_factory=list)
    _halt: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="soak-system-faults", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(30)
        for p in self._stopped:  # never leave a stopped process behind
            try:
                p.resume()
            except psutil.Error:
                pass

    # ---- following the job -----------------------------------------------------------
    def _read(self) -> None:
        try:
            with open(self.events, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        end = chunk.rfind(b"\n") + 1  # a line being written is read next time
        self._offset += end
        for line in chunk[:end].splitlines():
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if e.get("event") == "progress":
                self._step = max(self._step, int(e.get("step", 0)))
            elif e.get("event") == "controller_leader":
                self._leader = e

    def _run(self) -> None:
        todo = sorted(self.faults, key=lambda f: f.at_step)
        while todo and not self._halt.wait(0.05):
            self._read()
            while todo and self._step >= todo[0].at_step and self._leader is not None:
                f = todo.pop(0)
                try:
                    what = self._fire(f)
                except Exception as e:  # the harness must report, not die
                    what = f"failed: {type(e).__name__}: {e}"
                    self.errors.append(f"{f}: {what}")
                self.fired.append(Fired(str(f), time.monotonic(), what))

    # ---- the actions -------------------------------------------------------------------
    def replicas(self) -> list[psutil.Process]:
        out = []
        for p in psutil.process_iter(["pid", "cmdline"]):
            try:
                if "resild.controller.replica" in " ".join(p.info["cmdline"] or []) and (
                    p.environ().get("RESILD_SOAK_MARK") == self.mark
                ):
                    out.append(p)
            except psutil.Error:
                pass
        return out

    def _fire(self, f: SystemFault) -> str:
        assert self._leader is not None
        leader_pid = int(self._leader["pid"])
        if f.kind == "leaderkill":
            os.kill(leader_pid, signal.SIGKILL)
            return f"killed leader pid {leader_pid} (term {self._leader.get('term')})"
        if f.kind == "stall":
            if f.target == "leader":
                victim = psutil.Process(leader_pid)
            else:
                standbys = [p for p in self.replicas() if p.pid != leader_pid and p.status() != psutil.STATUS_ZOMBIE]
                if not standbys:
                    return "no standby alive: nothing stalled"
                victim = standbys[0]
            victim.suspend()
            self._stopped.append(victim)
            threading.Timer(f.seconds, self._resume, args=(victim,)).start()
            return f"stopped pid {victim.pid} ({f.target}) for {f.seconds:g}s"
        if f.kind == "diskfull":
            return fill(self.run_dir)
        if f.kind == "flood":
            node = f.target if f.target.startswith(self.node_prefix) else self.node_prefix + f.target
            return flood(str(self._leader["endpoint"]), self.run_dir / "keys" / "nodes" / node, node)
        raise ValueError(f.kind)

    def _resume(self, p: psutil.Process) -> None:
        try:
            p.resume()
        except psutil.Error:
            pass


def fill(directory: Path) -> str:
    """Write until the file system says ENOSPC; the file stays (full to the end)."""
    n = 0
    block = b"\0" * (1 << 20)
    try:
        with open(directory / "soak-filler", "wb") as f:
            while True:
                f.write(block)
                f.flush()
                n += 1
    except OSError as e:
        return f"filled {directory} ({n} MiB written, then {e.strerror})"


def flood(endpoint: str, key_dir: Path, node: str, count: int = 300, size: int = 1_000_000) -> str:
    """One node's key holder sends `count` large EVENTs as fast as it can."""
    import zmq

    from resild.wire.channel import connect
    from resild.wire.keys import KeyDir
    from resild.wire.protocol import Message, MsgType, encode

    ctx = zmq.Context()
    try:
        ch = connect(ctx, endpoint, KeyDir(key_dir), f"{node}/flood")
        body = {"node": node, "name": "spam", "fields": {"blob": "x" * size}}
        frame = encode(Message(MsgType.EVENT, f"{node}/flood", 1, time.time() + 3600, body))
        for seq in range(1, count + 1):  # each with its own seq: a replay would be refused
            ch.sock.send(frame.replace(b'"seq":1,', b'"seq":%d,' % seq), copy=False)
        time.sleep(0.5)  # let the frames leave before the socket closes
    finally:
        ctx.destroy(linger=0)
    return f"{count} x {size // 1000} kB EVENTs with {node}'s key"


class Tmpfs:
    """The run directory on a file system of its own (root only), so it can be filled."""

    def __init__(self, path: Path, size: str = TMPFS_SIZE) -> None:
        self.path, self.size, self.mounted = path, size, False

    def __enter__(self) -> Tmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={self.size}", "tmpfs", str(self.path)], check=True)
        self.mounted = True
        return self

    def __exit__(self, *exc: object) -> None:
        if self.mounted:
            # What the run left there (logs, journals, results) outlives the mount; not the filler.
            keep = self.path.with_name(self.path.name + "-kept")
            shutil.copytree(
                self.path,
                keep,
                ignore=shutil.ignore_patterns("soak-filler", "member*", "*.wal", "*.snap"),
                dirs_exist_ok=True,
            )
            subprocess.run(["umount", "-l", str(self.path)], check=False)


def can_mount() -> bool:
    return os.geteuid() == 0
