"""The node-local relay between a node process and its workers.

The controller sends ONE membership message per node (a few-byte delta when the
node holds the previous epoch, the node's view otherwise: its own ranks and the
world size, and the epoch's committed floor either way); the node process resolves
it to a layout (never a delta) and hands it, floor unchanged, to its local workers
over an ipc:// socket in a private directory (0700). Workers send their PROGRESS here: commits
are aggregated into one report per node (per node commit, at most one per
COMMIT_REPORT_S); every other state ("wait", "compute", "collective_failed", ...)
goes on at once, so the hang detector still sees each rank's state and can name
the culprit.

    worker: RelayClient(os.environ["RESILD_RELAY"], sender)  --RELAY_HELLO-->  node: RelayServer
            <-- MEMBERSHIP (a layout, never a delta; again on every hello) --

STORE (group formation) comes here too: the node process serves the keys of groups
that live on this node and forwards the rest (launcher/node/node_store.py), answering
with STORE_REPLY. Everything else (REGISTER_WORKER, EVENT, DONE, FAILED, FATAL) goes
from the worker to the controller directly, as without a relay.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any

import zmq

import resild.wire.env as resild_env
from resild.membership import DeltaMismatch, Membership
from resild.wire.channel import Channel
from resild.wire.protocol import Message, MsgType

log = logging.getLogger("resild.relay")

RELAY_ENV = resild_env.RELAY.name
COMMIT_REPORT_S = 0.1  # at most one aggregated commit report per node this often


# ---- pure parts (unit-tested without sockets) ------------------------------------------


@dataclass
class LayoutTracker:
    """The membership a node process holds (its view, or a full layout), kept current
    from the layouts and deltas the controller sends."""

    membership: Membership | None = None

    @property
    def epoch(self) -> int:
        return self.membership.epoch if self.membership is not None else 0

    def on_layout(self, body: dict[str, Any]) -> bool | None:
        """A layout (MEMBERSHIP); True when it is newer than what we hold, None when it is
        malformed (ask again: the controller validates what it sends, so it is a bug)."""
        try:
            m = Membership.from_dict(body)
        except (KeyError, TypeError, ValueError) as e:
            log.error("membership layout refused: %r", e)
            return None
        if m.epoch <= self.epoch:
            return False
        self.membership = m
        return True

    def on_delta(self, body: dict[str, Any]) -> bool | None:
        """A delta; True when applied, False when old news, None when it does not apply
        to what we hold (a missed epoch) or is malformed: ask the controller for the layout."""
        try:
            if int(body["epoch"]) <= self.epoch:
                return False
            if self.membership is None:
                return None
            self.membership = self.membership.apply_delta(body)
        except DeltaMismatch as e:
            log.warning("membership delta not applicable: %s", e)
            return None
        except (KeyError, TypeError, ValueError) as e:  # only generic checks at decode: the fields here
            log.error("membership delta refused: %r", e)
            return None
        return True


@dataclass
class CommitAggregator:
    """Per-rank commits in, one report per node out: when every local rank has committed
    (a node commit), or `interval_s` after the first pending commit if some rank lags,
    and never more often than every `interval_s`. A commit of a newer epoch is reported
    as soon as the interval allows (the controller times recoveries by it)."""

    interval_s: float = COMMIT_REPORT_S
    expected: int = 1  # local ranks in the current membership
    _epoch: int = 0
    _pending: dict[int, int] = field(default_factory=dict)  # rank -> committed step
    _first_s: float = 0.0
    _last_sent_s: float = -1e9
    _last_epoch: int = 0
    # Paces (launcher.worker.pace): each rank's running total as last heard, and as of its last
    # report; a report carries each rank's mean pace over the steps since (stragglers).
    _paced: dict[int, tuple[int, float]] = field(default_factory=dict)  # rank -> (step, total seconds)
    _reported: dict[int, tuple[int, float]] = field(default_factory=dict)
    _of: int = 0  # the steps the loop was asked for (job.steps(total)), as the ranks say

    def add(
        self, rank: int, epoch: int, step: int, now: float, paced_s: float | None = None, of: int | None = None
    ) -> None:
        if epoch < self._epoch:
            return  # a late commit of an epoch already superseded
        if epoch > self._epoch:
            self._pending.clear()
            self._epoch = epoch
        if not self._pending:
            self._first_s = now
        self._pending[rank] = step
        if paced_s is not None:
            self._paced[rank] = (step, paced_s)
        if of is not None:
            self._of = max(self._of, of)

    def _paces(self) -> dict[str, float]:
        """Each rank's mean pace over the steps since its last report (a rank that went back
        (a rollback) or restarted (a spare's new process) starts counting again)."""
        out: dict[str, float] = {}
        for rank, (step, total_s) in self._paced.items():
            prev = self._reported.get(rank)
            if prev is not None and step > prev[0] and total_s >= prev[1]:
                out[str(rank)] = round((total_s - prev[1]) / (step - prev[0]), 6)
            if prev is None or step != prev[0]:
                self._reported[rank] = (step, total_s)
        return out

    def due(self, now: float) -> bool:
        if not self._pending or now - self._last_sent_s < self.interval_s:
            return False
        return (
            len(self._pending) >= self.expected
            or self._epoch != self._last_epoch
            or now - self._first_s >= self.interval_s
        )

    def next_due_s(self) -> float | None:
        """When due() may next turn true (for the caller's poll timeout); None if nothing pending."""
        if not self._pending:
            return None
        t = self._last_sent_s + self.interval_s
        if len(self._pending) < self.expected and self._epoch == self._last_epoch:
            t = max(t, self._first_s + self.interval_s)
        return t

    def take(self, now: float) -> dict[str, Any] | None:
        """The report body part {"epoch", "commits": {rank: step}} (ignores due()); None if empty."""
        if not self._pending:
            return None
        body: dict[str, Any] = {
            "epoch": self._epoch,
            "state": "commit",
            "commits": {str(r): s for r, s in self._pending.items()},
        }
        paces = self._paces()
        if paces:
            body["paces"] = paces
        if self._of:
            body["of"] = self._of
        self._pending = {}
        self._last_sent_s, self._last_epoch = now, self._epoch
        return body


def leader_heartbeat_due(now: float, last_report_s: float, interval_s: float, news: bool) -> bool:
    """Does this periodic heartbeat go to the leader too? Not when a commit report reached
    it within the interval: the leader counts that report as the node's heartbeat (it comes
    from the node process's own socket), and a node would otherwise cost it two messages
    per interval. `news` (a new epoch held, a changed relay set) always goes. Standbys get
    every heartbeat: a replica that takes over must know every node at once."""
    return news or now - last_report_s >= interval_s


# ---- node side -----------------------------------------------------------------------


RELAY_DIR_PREFIX = "resild-relay-"


def sweep_stale_relay_dirs(parent: str | None = None) -> list[str]:
    """Remove relay directories left by node processes that died without closing them (SIGKILL,
    a lost host): each name carries its owner's pid, and only this user's dirs whose pid is gone
    are removed. Returns what was removed."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid_text = name[len(RELAY_DIR_PREFIX) :].split("-", 1)[0]
        if not name.startswith(RELAY_DIR_PREFIX) or not pid_text.isdigit():
            continue
        path = os.path.join(parent, name)
        try:
            if os.lstat(path).st_uid != os.getuid() or _alive(int(pid_text)):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


class RelayServer:
    """The node process's end: a ROUTER on ipc:// in a private directory."""

    def __init__(self, ctx: zmq.Context[Any], node: str, run_dir: str | None = None) -> None:
        self.node = node
        sweep_stale_relay_dirs(run_dir)
        # 0700: only this user connects; the pid in the name lets a later node process sweep it
        self._dir = tempfile.mkdtemp(prefix=f"{RELAY_DIR_PREFIX}{os.getpid()}-", dir=run_dir)
        self.endpoint = f"ipc://{self._dir}/relay.sock"
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(self.endpoint)
        os.chmod(f"{self._dir}/relay.sock", 0o600)
        self.ch = Channel(sock, f"{node}/relay", router=True)
        self.sock = sock
        self.workers: dict[int, bytes] = {}  # local rank -> routing id of its RelayClient
        self._layout: dict[str, Any] | None = None

    def set_membership(self, m: Membership) -> None:
        """A new epoch: every connected worker gets the layout."""
        self._layout = m.to_dict()
        for ident in self.workers.values():
            self.ch.send(MsgType.MEMBERSHIP, self._layout, to=ident, ttl_s=600)

    def broadcast(self, mtype: MsgType, body: dict[str, Any]) -> None:
        for ident in self.workers.values():
            self.ch.send(mtype, body, to=ident)

    def recv(self) -> tuple[bytes, Message] | None:
        """One pending worker message (non-blocking); a hello is answered here and returned too."""
        got = self.ch.recv(0)
        if got is None:
            return None
        ident, msg = got
        assert ident is not None
        if msg.type == MsgType.RELAY_HELLO:
            lr = msg.body.get("local_rank")
            if isinstance(lr, int) and not isinstance(lr, bool) and lr >= 0:
                self.workers[lr] = ident
            if self._layout is not None:  # joined late, or missed epochs: the current layout
                self.ch.send(MsgType.MEMBERSHIP, self._layout, to=ident, ttl_s=600)
        return ident, msg

    def forget(self, local_rank: int) -> None:
        self.workers.pop(local_rank, None)

    def close(self) -> None:
        self.ch.close()
        shutil.rmtree(self._dir, ignore_errors=True)


# ---- worker side ---------------------------------------------------------------------
