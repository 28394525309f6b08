"""The node agent: probes, health reports to the controller, local status socket.

Threads: the *prober* runs every probe each ``probe_interval_s`` and at once
when the NVML event thread or the kmsg follower reports something; the *main
loop* owns every ZeroMQ socket (sockets are not thread-safe): it answers the
local status socket, sends HEALTH the moment the published verdict changes and
HEARTBEAT every ``heartbeat_s``, watches registered training processes and
pings the systemd watchdog. A hung probe therefore never stalls the status
socket or the heartbeat; it only turns FAILED (probes.ProbeRunner).

Local socket (AF_UNIX stream at <status_socket>, transport.UnixServer: length-
prefixed protocol.Message frames; the peer's uid/pid come from the kernel):
  STATUS -> STATUS_REPLY {node, verdict, reasons, probes, gpus, processes, ...}
  REGISTER_WORKER {pid, name} / PROGRESS {pid, step} -> STATUS_REPLY {ok: true}
  SUBSCRIBE_HEALTH -> HEALTH {node, verdict, reasons, detector, push_interval_s} at once,
      then a HEALTH push on the same connection each time the published verdict or its
      reasons change (the moment the controller is told), and every push_interval_s as a
      keepalive, so a subscriber can tell a silent daemon from a quiet node. The job's node
      process subscribes (launcher/node/health_source.py): one health source per node.
Who may do what: the socket is 0660 in group `status_group` (config; world-
accessible with a warning when that group does not exist). Anyone connected may
ask for STATUS; a non-root peer may register and report progress only for its
own processes (same real uid), never for another user's or pid 1. Names are
bounded and sanitized, watched processes capped, and a reply never exceeds the
frame limit, so no client can make `resild status` fail for the others. Anyone who
may ask for STATUS may subscribe; subscribers are capped (in all and per uid), and
one that does not read its pushes is dropped (backlog or stall bound) instead of
ever blocking the loop.
"""

from __future__ import annotations

import enum
import grp
import json
import logging
import os
import resource
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import zmq

from resild.daemon.metrics import Metrics
from resild.events.schema import Detector, EventName
from resild.health.config import Config
from resild.health.model import HealthEvent, Verdict
from resild.health.probes import Outcome, Probe, ProbeRunner, aggregate, build_probes, start_probes, stop_probes
from resild.wire.channel import Channel, connect
from resild.wire.keys import KeyDir
from resild.wire.local_socket import Peer, UnixServer, local_request, unix_path
from resild.wire.protocol import MAX_FRAME_BYTES, Message, MsgType, ProtocolError, Sequencer, decode, encode

log = logging.getLogger("resild.daemon")
LOOP_TICK_S = 0.05  # bounds the delay from a verdict change to its HEALTH message
PROC_CHECK_INTERVAL_S = 0.5
MAX_WATCHED = 1024  # processes watched at once (all users)
MAX_WATCHED_PER_UID = 256
EXITED_KEEP_S = 600.0  # an exited process stays visible in `resild status` this long
MAX_REASONS, MAX_REASON_CHARS = 64, 1024
NOFILE_WANTED = 65536  # systemd's LimitNOFILE= sets it too; this covers a manual start
MAX_SUBSCRIBERS = 64  # health subscriptions at once (one per job node process is the norm)
MAX_SUBSCRIBERS_PER_UID = 16
# Root and the daemon's own uid subscribe outside the cap above, within this many of their
# own: four users at their per-uid share filled the cap and locked root out (issue 39).
MAX_PRIVILEGED_SUBSCRIBERS = 16
PUSH_INTERVAL_S = 5.0  # keepalive push: a subscriber calls the daemon gone after ~3 of these
MAX_PUSH_BACKLOG_BYTES = 1 << 20  # queued for one subscriber beyond the kernel's buffer: dropped
PUSH_STALL_S = 15.0  # a subscriber whose queue has not drained for this long is dropped
# A prober round may take probe_interval_s (waiting) plus probe_timeout_s per probe (each
# probe has a deadline); beyond that plus this slack (scheduling on a loaded node) it is stuck.
PROBER_SLACK_S = 2.0


def _printable(text: str, limit: int) -> str:
    """Names land in terminals (`resild status`): no control characters, bounded."""
    return "".join(ch if ch.isprintable() else "?" for ch in text[:limit])


def _bounded_reasons(reasons: list[str]) -> list[str]:
    out = [r[:MAX_REASON_CHARS] for r in reasons[:MAX_REASONS]]
    if len(reasons) > MAX_REASONS:
        out.append(f"... and {len(reasons) - MAX_REASONS} more")
    return out


def raise_nofile_limit(wanted: int = NOFILE_WANTED) -> int:
    """Raise the soft open-files limit toward the hard one; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-files limit to %d: %s", target, e)
    return soft


# -- systemd notify protocol (sd_notify(3)), no libsystemd needed ---------------------


def sd_notify(state: str, env: Mapping[str, str] | None = None) -> bool:
    """Send one datagram to $NOTIFY_SOCKET; False when not under systemd or it fails."""
    addr = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):  # abstract namespace
        addr = "\0" + addr[1:]
    try:
        # Non-blocking: a receiver whose queue is full must never stall the main loop.
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK) as s:
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as e:
        log.warning("sd_notify(%s) failed: %s", state, e)
        return False


def watchdog_interval_s(env: Mapping[str, str] | None = None) -> float | None:
    """Half of WatchdogSec (systemd's advice), or None when no watchdog is asked of us."""
    env = os.environ if env is None else env
    try:
        usec = int(env.get("WATCHDOG_USEC", "0"))
    except ValueError:
        return None
    pid = env.get("WATCHDOG_PID")
    if usec <= 0 or (pid and pid != str(os.getpid())):
        return None
    return usec / 2e6


# -- watched training processes (pure judgement) --------------------------------------


class ProcState(str, enum.Enum):
    RUNNING = "running"
    EXITED = "exited"
    ZOMBIE = "zombie"
    HUNG = "hung"


@dataclass
class Watched:
    pid: int
    name: str
    create_time: float  # psutil's, guards against pid reuse
    last_progress_s: float  # monotonic
    step: int | None = None
    state: ProcState = ProcState.RUNNING
    reason: str = ""
    uid: int = 0  # real uid of the process: only it (or root) may report for it
    exited_s: float | None = None  # monotonic, when it was first seen gone


def judge_process(now: float, w: Watched, alive: bool, zombie: bool, stall_timeout_s: float) -> tuple[ProcState, str]:
    if w.state is ProcState.EXITED or not alive:
        return ProcState.EXITED, w.reason or "process exited"
    if zombie:
        return ProcState.ZOMBIE, "zombie: exited but not reaped by its parent"
    idle_s = now - w.last_progress_s
    if idle_s > stall_timeout_s:
        return ProcState.HUNG, f"no progress for {idle_s:.0f}s (stall_timeout_s={stall_timeout_s:g})"
    return ProcState.RUNNING, ""


def _observe(w: Watched) -> tuple[bool, bool]:
    try:
        p = psutil.Process(w.pid)
        if abs(p.create_time() - w.create_time) > 0.01:
            return False, False  # pid reused: ours is gone
        return True, p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False, False
    except psutil.AccessDenied:
        return True, False


# -- health snapshot ----------------------------------------------------------------


@dataclass
class NodeHealth:
    verdict: Verdict = Verdict.FAILED  # fail closed until the first check has run
    reasons: list[str] = field(default_factory=lambda: ["no check has run yet"])
    outcomes: dict[str, Outcome] = field(default_factory=dict)
    checked_mono: float | None = None
    version: int = 0


def health_key(verdict: Verdict, reasons: list[str]) -> tuple[str, tuple[str, ...]]:
    """What must change for a new HEALTH message (not the order of reasons)."""
    return verdict.value, tuple(sorted(reasons))


class PushServer(UnixServer):
    """UnixServer plus server pushes for health subscriptions.

    The request handler calls `subscribe_serving()` to turn the connection whose request
    it is answering into a subscriber: it stays open past idle_timeout_s and gets every
    `push()`. A push only appends to the connection's buffer and tries one non-blocking
    send (the poll loop flushes the rest), so it never blocks; a subscriber whose queue
    exceeds `max_backlog_bytes`, or has not drained for `stall_s`, is closed."""

    def __init__(
        self,
        *args: Any,
        max_subscribers: int = MAX_SUBSCRIBERS,
        max_subscribers_per_uid: int = MAX_SUBSCRIBERS_PER_UID,
        max_backlog_bytes: int = MAX_PUSH_BACKLOG_BYTES,
        stall_s: float = PUSH_STALL_S,
        **kw: Any,
    ) -> None:
        super().__init__(*args, **kw)
        self.max_subscribers, self.max_subscribers_per_uid = max_subscribers, max_subscribers_per_uid
        self.max_backlog_bytes, self.stall_s = max_backlog_bytes, stall_s
        self.subscribers: dict[int, float | None] = {}  # fd -> since when its queue is backed up
        self.dropped_subscribers = 0
        self._serving: Any = None  # the connection whose request the handler is answering

    def _serve(self, c: Any) -> None:
        self._serving = c
        try:
            super()._serve(c)
        finally:
            self._serving = None

    def subscribe_serving(self) -> None:
        """From the handler: the current connection becomes a subscriber (ProtocolError if full)."""
        c = self._serving
        if c is None:
            raise ProtocolError("unexpected", "subscribe over the status socket")
        fd = c.sock.fileno()
        if fd in self.subscribers:
            return
        subs = [self.conns[f] for f in self.subscribers if f in self.conns]
        if c.privileged:  # their own slots: no other user can take them
            mine = sum(1 for s in subs if s.privileged)
            if mine >= MAX_PRIVILEGED_SUBSCRIBERS:
                raise ProtocolError("too_many", f"{mine} health subscribers of root and the daemon's uid already")
        else:
            others = [s for s in subs if not s.privileged]
            same_uid = sum(1 for s in others if s.peer.uid == c.peer.uid)
            if len(others) >= self.max_subscribers or same_uid >= self.max_subscribers_per_uid:
                raise ProtocolError("too_many", f"{len(others)} health subscribers already")
        self.subscribers[fd] = None

    def push(self, frame: bytes) -> None:
        data = len(frame).to_bytes(4, "big") + frame  # transport's length prefix (!I)
        for fd in list(self.subscribers):
            c = self.conns.get(fd)
            if c is None:
                self.subscribers.pop(fd, None)
                continue
            if len(c.outbuf) + len(data) > self.max_backlog_bytes:
                self._drop(c, f"{len(c.outbuf)} bytes not read")
                continue
            c.outbuf += data
            self._flush(c)

    def reap_idle(self, now: float) -> None:
        for fd, since in list(self.subscribers.items()):
            c = self.conns.get(fd)
            if c is None:
                self.subscribers.pop(fd, None)
                continue
            c.last_s = now  # a subscriber is quiet by design: never reaped as idle
            if not c.outbuf:
                self.subscribers[fd] = None
            elif since is None:
                self.subscribers[fd] = now
            elif now - since > self.stall_s:
                self._drop(c, f"its pushes not read for {now - since:.0f}s")
        super().reap_idle(now)

    def _drop(self, c: Any, why: str) -> None:
        self.dropped_subscribers += 1
        log.warning("local socket: dropping health subscriber uid %d pid %d: %s", c.peer.uid, c.peer.pid, why)
        self._close(c)

    def _close(self, c: Any) -> None:
        self.subscribers.pop(c.sock.fileno(), None)
        super()._close(c)


class Agent:
    def __init__(self, cfg: Config, probes: list[Probe] | None = None, ctx: zmq.Context[Any] | None = None) -> None:
        self.cfg = cfg
        self.metrics = Metrics(cfg.node)
        self._trigger = threading.Event()
        self._stop = threading.Event()
        self.probes = probes if probes is not None else build_probes(cfg, on_event=self._on_health_event, follow=True)
        self.runners = [ProbeRunner(p, cfg.probe_timeout_s) for p in self.probes]
        self.ctx = ctx or zmq.Context()
        self._lock = threading.Lock()
        self.snap = NodeHealth()
        self.procs: dict[int, Watched] = {}
        self._rep: PushServer | None = None
        self._push_seq = Sequencer(f"{cfg.node}/agent")
        self._last_push_mono = 0.0
        self._ctl: Channel | None = None
        self._started_mono = time.monotonic()
        self._last_hb_mono: float | None = None
        self._sent_key: tuple[str, tuple[str, ...]] | None = None
        self._prober: threading.Thread | None = None
        self._prober_beat = time.monotonic()  # the prober's last sign of life (monotonic)
        self._prober_problem_seen: str | None = None
        self._last_ctl_error: Any = None
        self._loop_done = threading.Event()
        self._loop_done.set()  # cleared while run() owns the sockets

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> None:
        """Bind the status socket, connect, start probes and run the first check."""
        raise_nofile_limit()
        self._rep = self._bind_status()
        if self.cfg.controller:
            keys = KeyDir(Path(self.cfg.keys_dir)) if self.cfg.keys_dir else None
            self._ctl = connect(self.ctx, self.cfg.controller, keys, sender=f"{self.cfg.node}/agent")
        if self.cfg.metrics_port:
            self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_addr)
        start_probes(self.probes)
        self._check_once()
        self._prober = threading.Thread(target=self._prober_loop, name="prober", daemon=True)
        self._prober.start()

    def stop(self) -> None:
        self._stop.set()
        self._trigger.set()

    def close(self) -> None:
        self.stop()
        self._loop_done.wait(2.0)  # sockets belong to run()'s thread until it returns
        if self._prober is not None:
            self._prober.join(self.cfg.probe_timeout_s + 1)
        stop_probes(self.probes)
        self.metrics.close()
        if self._rep is not None:
            self._rep.close()
        if self._ctl is not None:
            self._ctl.close()
        path = unix_path(self.cfg.status_endpoint)
        if path is not None and self._rep is not None:
            Path(path).unlink(missing_ok=True)

    def _bind_status(self) -> PushServer:
        ep = self.cfg.status_endpoint
        p = unix_path(ep)
        if p is None:
            raise RuntimeError(f"status_socket {ep!r}: the daemon serves a local unix socket only (a path)")
        path = Path(p)
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() or path.is_symlink():
            if local_request(ep, MsgType.STATUS, timeout_s=0.5) is not None:
                raise RuntimeError(f"another resild daemon already answers on {ep}")
            path.unlink()  # stale socket of a dead daemon
        gid, mode = None, 0o660
        if self.cfg.status_group:
            try:
                gid = grp.getgrnam(self.cfg.status_group).gr_gid
            except KeyError:
                mode = 0o666
                log.warning(
                    "group %r does not exist: the status socket is open to every local user "
                    "(each may still only register its own processes); create it with "
                    "`groupadd --system %s` to restrict the socket to its members",
                    self.cfg.status_group,
                    self.cfg.status_group,
                )
        else:
            mode = 0o666
        return PushServer(str(path), self._handle_local, mode=mode, gid=gid)

    # -- probing (prober thread) -------------------------------------------------------
    def _on_health_event(self, ev: HealthEvent) -> None:  # NVML / kmsg threads
        log.warning("health event: %s", ev.reason)
        self.metrics.on_event(ev)
        self._trigger.set()

    def _prober_loop(self) -> None:
        """Supervised: whatever a round raises becomes a FAILED verdict with the reason, and
        the next round runs as usual (a dead prober once left a node HEALTHY for good)."""
        while not self._stop.is_set():
            self._prober_beat = time.monotonic()
            self._trigger.wait(self.cfg.probe_interval_s)
            self._trigger.clear()
            if self._stop.is_set():
                return
            self._prober_beat = time.monotonic()
            try:
                self._check_once()
            except Exception as e:
                log.exception("a health check round failed")
                self._fail_closed(f"health check failed: {type(e).__name__}: {e}")

    def _fail_closed(self, reason: str) -> None:
        """Publish FAILED with `reason` (once: the same reason again changes nothing)."""
        with self._lock:
            if self.snap.verdict is Verdict.FAILED and self.snap.reasons == [reason]:
                return
            self.snap = NodeHealth(
                Verdict.FAILED, [reason], self.snap.outcomes, time.monotonic(), self.snap.version + 1
            )
        try:
            self.metrics.on_node(Verdict.FAILED)
        except Exception:
            log.exception("cannot export the FAILED verdict")

    def prober_deadline_s(self) -> float:
        return self.cfg.probe_interval_s + len(self.runners) * self.cfg.probe_timeout_s + PROBER_SLACK_S

    def prober_problem(self, now: float) -> str | None:
        """Why the prober is not doing its job (dead or stuck), or None while it is."""
        if self._prober is None or self._stop.is_set():
            return None
        if not self._prober.is_alive():
            return "the prober thread is dead: health is not being checked"
        deadline_s = self.prober_deadline_s()
        if now - self._prober_beat > deadline_s:
            return f"the prober has made no round for over {deadline_s:g}s (stuck): health is not being checked"
        return None

    def _supervise_prober(self, now: float) -> bool:
        """From the main loop: True while the prober is alive and making rounds; otherwise
        the verdict is FAILED with the reason (and the caller stops feeding the watchdog)."""
        problem = self.prober_problem(now)
        if problem != self._prober_problem_seen:
            if problem is not None:
                log.error("%s; the systemd watchdog is no longer fed", problem)
            self._prober_problem_seen = problem
        if problem is None:
            return True
        self._fail_closed(problem)
        return False

    def _check_once(self) -> None:
        outcomes = {r.name: r.run() for r in self.runners}
        verdict, reasons = aggregate({n: o.result for n, o in outcomes.items()})
        self.metrics.on_outcomes(outcomes)
        self.metrics.on_node(verdict)
        with self._lock:
            self.snap = NodeHealth(verdict, reasons, outcomes, time.monotonic(), self.snap.version + 1)

    # -- main loop ---------------------------------------------------------------------
    def run(self) -> None:
        assert self._rep is not None, "start() first"
        self._loop_done.clear()
        poller = zmq.Poller()
        self._rep.register(poller)
        if self._ctl is not None:
            poller.register(self._ctl.sock, zmq.POLLIN)
        wd_s = watchdog_interval_s()
        next_wd = time.monotonic()
        next_proc = time.monotonic()
        sd_notify(f"READY=1\nSTATUS=serving {self.cfg.status_endpoint}")
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(int(LOOP_TICK_S * 1000)))
                for fd, ev in ready.items():
                    if isinstance(fd, int) and self._rep.owns(fd):
                        self._rep.on_ready(fd, ev)
                if self._ctl is not None and self._ctl.sock in ready:
                    try:
                        self._from_controller()
                    except Exception:
                        log.exception("handling a controller message failed")
                now = time.monotonic()
                self._rep.reap_idle(now)
                prober_ok = self._supervise_prober(now)
                self._report(now)
                if now >= next_proc:
                    self._watch_processes(now)
                    next_proc = now + PROC_CHECK_INTERVAL_S
                # A dead or stuck prober starves the watchdog: systemd restarts the daemon
                # instead of it answering the socket with a verdict nobody checks any more.
                if wd_s is not None and now >= next_wd and prober_ok:
                    sd_notify("WATCHDOG=1")
                    next_wd = now + wd_s
        finally:
            sd_notify("STOPPING=1")
            self._loop_done.set()

    def _report(self, now: float) -> None:
        with self._lock:
            snap = self.snap
        key = health_key(snap.verdict, snap.reasons)
        if key != self._sent_key and snap.checked_mono is not None:
            self._sent_key = key
            log.log(
                logging.INFO if snap.verdict is Verdict.HEALTHY else logging.WARNING,
                "node verdict %s: %s",
                snap.verdict.value,
                "; ".join(snap.reasons) or "ok",
            )
            self._write_state()
            if self._ctl is not None:
                self._ctl.send(MsgType.HEALTH, self._health_body(snap))
            self._push_health(snap, now)  # subscribers hear it at the same moment
        elif self._rep is not None and self._rep.subscribers and now - self._last_push_mono >= PUSH_INTERVAL_S:
            self._push_health(snap, now)  # keepalive: the same verdict again
        if self._ctl is not None and (self._last_hb_mono is None or now - self._last_hb_mono >= self.cfg.heartbeat_s):
            self._ctl.send(MsgType.HEARTBEAT, {"node": self.cfg.node, "health": snap.verdict.value, "source": "agent"})
            self._last_hb_mono = now
        if self._last_hb_mono is not None:
            self.metrics.heartbeat_age.labels(self.cfg.node).set(now - self._last_hb_mono)

    def _health_body(self, snap: NodeHealth) -> dict[str, Any]:
        return {
            "node": self.cfg.node,
            "verdict": snap.verdict.value,
            "reasons": _bounded_reasons(snap.reasons),
            "detector": Detector.AGENT.value,
        }

    def _push_health(self, snap: NodeHealth, now: float) -> None:
        self._last_push_mono = now
        if self._rep is None or not self._rep.subscribers:
            return
        body = {**self._health_body(snap), "push_interval_s": PUSH_INTERVAL_S}
        self._rep.push(encode(self._push_seq.make(MsgType.HEALTH, body)))

    def _from_controller(self) -> None:
        assert self._ctl is not None
        while (got := self._ctl.recv(0)) is not None:
            _, msg = got
            if msg.type is MsgType.ERROR:
                if msg.body.get("code") != self._last_ctl_error:  # once per streak, not per heartbeat
                    log.warning("controller: %s: %s", msg.body.get("code"), msg.body.get("detail"))
                self._last_ctl_error = msg.body.get("code")
            elif msg.type is MsgType.FENCE:
                log.error("controller fenced this node: %s", msg.body.get("reason"))
            else:
                log.info("controller sent %s (ignored by the agent)", msg.type.value)

    def _write_state(self) -> None:
        """Last verdict on disk, for post-mortems; best effort (state_dir may be absent)."""
        try:
            path = Path(self.cfg.state_dir) / "last_status.json"
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.status()))
            os.replace(tmp, path)
        except OSError:
            pass

    # -- local status socket ---------------------------------------------------------
    def _handle_local(self, frame: bytes, peer: Peer) -> bytes:
        """One request on the local socket -> one reply frame; never raises."""
        seq = Sequencer(f"{self.cfg.node}/agent")
        try:
            msg = decode(frame)
            body = self._answer(msg, peer)
            # A subscription is answered with the verdict itself, in the shape of its pushes.
            reply = seq.make(MsgType.HEALTH if msg.type is MsgType.SUBSCRIBE_HEALTH else MsgType.STATUS_REPLY, body)
        except ProtocolError as e:
            reply = seq.make(MsgType.ERROR, {"code": e.code, "detail": e.detail[:1024]})
        except Exception as e:
            log.exception("status request failed")
            reply = seq.make(MsgType.ERROR, {"code": "internal", "detail": str(e)[:1024]})
        try:
            out = encode(reply)
        except (TypeError, ValueError) as e:
            log.error("status reply not encodable: %s", e)
            out = encode(seq.make(MsgType.ERROR, {"code": "internal", "detail": "reply not encodable"}))
        if len(out) > MAX_FRAME_BYTES:
            out = encode(seq.make(MsgType.ERROR, {"code": "too_large", "detail": f"reply of {len(out)} bytes"}))
        return out

    def _answer(self, msg: Message, peer: Peer | None = None) -> dict[str, Any]:
        """`peer` None: an in-process caller (tests), trusted like root."""
        b = msg.body
        uid = 0 if peer is None else peer.uid
        if msg.type is MsgType.STATUS:
            return self.status()
        if msg.type is MsgType.SUBSCRIBE_HEALTH:  # whoever may ask for STATUS may subscribe
            if self._rep is None:
                raise ProtocolError("unexpected", "subscribe over the status socket")
            self._rep.subscribe_serving()
            with self._lock:
                snap = self.snap
            return {**self._health_body(snap), "push_interval_s": PUSH_INTERVAL_S}
        if msg.type is MsgType.REGISTER_WORKER:
            pid = _int(b.get("pid"), "pid")
            try:
                p = psutil.Process(pid)
                ct, owner = p.create_time(), p.uids().real
            except psutil.NoSuchProcess:
                raise ProtocolError("no_such_process", f"pid {pid} does not exist") from None
            except psutil.AccessDenied:
                raise ProtocolError("forbidden", f"pid {pid} cannot be inspected") from None
            if uid != 0 and (owner != uid or pid == 1):
                log.warning(
                    "uid %d (pid %d) tried to register pid %d of uid %d: refused",
                    uid,
                    peer.pid if peer else 0,
                    pid,
                    owner,
                )
                raise ProtocolError("forbidden", f"pid {pid} is not yours: register your own processes only")
            name = _printable(str(b.get("name") or f"pid {pid}"), 128)
            now = time.monotonic()
            with self._lock:
                self._forget_exited(now)
                if pid not in self.procs:
                    if len(self.procs) >= MAX_WATCHED:
                        raise ProtocolError("too_many", f"{MAX_WATCHED} processes are watched already")
                    if sum(1 for w in self.procs.values() if w.uid == owner) >= MAX_WATCHED_PER_UID:
                        raise ProtocolError("too_many", f"uid {owner} has {MAX_WATCHED_PER_UID} watched processes")
                self.procs[pid] = Watched(pid, name, ct, now, uid=owner)
            return {"ok": True}
        if msg.type is MsgType.PROGRESS:
            pid = _int(b.get("pid"), "pid")
            with self._lock:
                w = self.procs.get(pid)
                if w is None:
                    raise ProtocolError("not_watched", f"pid {pid} is not registered")
                if uid != 0 and uid != w.uid:
                    raise ProtocolError("forbidden", f"pid {pid} is not yours")
                w.last_progress_s = time.monotonic()
                w.step = b.get("step") if isinstance(b.get("step"), int) else w.step
            return {"ok": True}
        raise ProtocolError("unexpected", f"{msg.type.value} not accepted on the status socket")

    def _forget_exited(self, now: float) -> None:
        """Caller holds the lock. Exited processes are dropped after EXITED_KEEP_S."""
        for pid in [p for p, w in self.procs.items() if w.exited_s is not None and now - w.exited_s > EXITED_KEEP_S]:
            del self.procs[pid]

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        with self._lock:
            snap = self.snap
            procs = [
                {**asdict(w), "state": w.state.value, "idle_s": round(now - w.last_progress_s, 1)}
                for w in self.procs.values()
            ]
        gpu = snap.outcomes.get("gpu")
        return {
            "node": self.cfg.node,
            "verdict": snap.verdict.value,
            "reasons": _bounded_reasons(snap.reasons),
            "probes": {
                n: {**o.result.to_dict(), "latency_s": round(o.latency_s, 4), "error": o.error}
                for n, o in snap.outcomes.items()
            },
            "gpus": gpu.result.details.get("gpus", []) if gpu else [],
            "processes": procs,
            "controller": self.cfg.controller or None,
            "heartbeat_age_s": None if self._last_hb_mono is None else round(now - self._last_hb_mono, 3),
            "checked_age_s": None if snap.checked_mono is None else round(now - snap.checked_mono, 3),
            "uptime_s": round(now - self._started_mono, 1),
        }

    def _watch_processes(self, now: float) -> None:
        with self._lock:
            watched = list(self.procs.values())
        counts = {s: 0 for s in ProcState}
        for w in watched:
            alive, zombie = _observe(w)
            state, reason = judge_process(now, w, alive, zombie, self.cfg.stall_timeout_s)
            counts[state] += 1
            if state is not w.state:
                log.warning("watched process %s (pid %d): %s %s", w.name, w.pid, state.value, reason)
                if self._ctl is not None:
                    self._ctl.send(
                        MsgType.EVENT,
                        {
                            "node": self.cfg.node,
                            "name": EventName(f"process_{state.value}"),
                            "fields": {"pid": w.pid, "name": w.name, "reason": reason},
                        },
                    )
            w.state, w.reason = state, reason
            if state is ProcState.EXITED and w.exited_s is None:
                w.exited_s = now
        for s, n in counts.items():
            self.metrics.watched.labels(self.cfg.node, s.value).set(n)


def _int(v: Any, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ProtocolError("malformed", f"{what} must be a positive integer")
    return v
