"""The per-node process: starts this node's workers, reports their exits at once
(pidfd, no polling), heartbeats to the controller, relays GPU health, executes
FENCE / SHUTDOWN / INJECT. One per allocated node, active or spare.

It is also its workers' relay (launcher/node/relay.py): the controller sends it one
membership message per epoch (a delta when it holds the previous epoch, else its
view: its ranks and the world size), which it hands to its workers as a layout;
their commits are aggregated into one report per node. Its heartbeats carry the
epoch it holds, so the controller sends its view again if it missed an epoch.

    python -m launcher.node --node NODE --controller tcp://HOST:PORT --keys DIR --nproc N -- CMD...

With controller_timeout_s T in --settings, no word from the controller for T seconds (the lease) stops the
workers and exits 75. In a Slurm job step (srun) it first releases the allocation, which Slurm
would otherwise hold until the time limit when the batch host dies (launcher/node/lease.py):
RESILD_ON_CONTROLLER_LOST=requeue (default: scontrol requeue with the reason in the job's
comment, else scancel when the job is not requeueable), cancel (scancel) or none.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq

import launcher.node.lease as lease
import resild.wire.env as resild_env
from launcher.node.node_store import NodeStore
from launcher.node.relay import RELAY_ENV, CommitAggregator, LayoutTracker, RelayServer, leader_heartbeat_due
from launcher.node.stale import sweep
from launcher.node.worker_output import OutputTail, mismatch_line
from resild.events.schema import Detector
from resild.procutil import die_with_parent, say
from resild.wire.exits import CONTROLLER_LOST_EXIT, FENCED_EXIT
from resild.wire.keys import KeyDir
from resild.wire.leader import ControllerSet
from resild.wire.protocol import Message, MsgType
from resild.wire.settings import QUALIFY_TIMEOUT_S, JobSettings

if TYPE_CHECKING:  # imported when the probe starts (_start_probe)
    from launcher.node.health_source import HealthSource

log = logging.getLogger("resild.node")


@dataclass
class Worker:
    local_rank: int
    proc: subprocess.Popen[bytes]
    pidfd: int
    out: OutputTail | None = None  # its stderr, passed through (launcher/node/worker_output.py)


class NodeProcess:
    def __init__(
        self,
        node: str,
        controller: str,
        keys: KeyDir | None,
        nproc: int,
        cmd: list[str],
        settings: JobSettings | None = None,
        nvml_control: Path | None = None,
        probe_interval_s: float = 1.0,
        qualify: bool = False,
    ) -> None:
        self.node, self.nproc, self.cmd = node, nproc, cmd
        self.qualify = qualify  # a node that joined: qualified before it may hold ranks
        settings = settings or JobSettings()
        self.heartbeat_s = settings.heartbeat_interval_s  # the controller may ask for less often (WELCOME)
        self.controller = controller
        # The lease: with no word from the controller this long, stop the workers and exit,
        # so a dead (or frozen) controller never leaves processes behind. 0: never. Until
        # the first LEASE it is --controller-timeout; then the controller says (at scale it
        # leases less often and the wait grows: JobSettings.for_nodes, computed there once).
        self.lease_timeout_s = settings.controller_timeout_s
        self.last_word_s = time.monotonic()
        self.ctx = zmq.Context()
        # One link per controller replica (comma-separated endpoints); sends go to the leader.
        self.ch = ControllerSet(self.ctx, controller.split(","), keys, sender=f"{node}/node")
        self.exited: list[dict[str, Any]] = []  # worker exits so far: told again to a new leader
        self.health: dict[str, Any] | None = None  # the newest health verdict sent: told again to a new leader
        self.env = {
            **os.environ,
            resild_env.CONTROLLER.name: controller,
            resild_env.NODE.name: node,
            resild_env.NPROC.name: str(nproc),
        }
        # NCCL: on a communicator error abort it but keep the process (the controller's
        # notice, not torch's watchdog, decides what happens next).
        self.env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if keys is not None:
            self.env[resild_env.KEYS.name] = str(keys.path)
        self.workers: dict[int, Worker] = {}
        self.health_q: queue.Queue[dict[str, Any]] = queue.Queue()
        self._wake_r, self._wake_w = os.pipe()
        self.nvml_control = nvml_control
        self.probe: HealthSource | None = None
        self.probe_interval_s = probe_interval_s
        self.exit_code: int | None = None
        self.exit_grace_s = float(os.environ.get(resild_env.EXIT_GRACE_S.name, resild_env.EXIT_GRACE_S.default))
        self.shutting_down_until: float | None = None
        self.layout = LayoutTracker()
        self.commits = CommitAggregator(expected=nproc)
        self.relay: RelayServer | None = None
        self.store = NodeStore()  # node-local groups' keys, and the job's thinned out (node_store.py)
        self._relayed_sent: list[int] | None = None  # the relayed set the controller last heard
        self._report_s = -1e9  # when a commit report last went to the leader (it is a heartbeat too)
        self._epoch_sent = -1  # the epoch the leader last heard we hold, in a heartbeat

    # ---- health: the node daemon's verdict, or the same probes in-process -----
    def _start_probe(self) -> None:
        # self.probe is the node's one health source (launcher/node/health_source.py).
        from launcher.node.health_source import open_health_source

        self.probe = open_health_source(
            self.node, self._on_health_event, self.nvml_control, interval_s=self.probe_interval_s
        )

    def _on_health_event(self, body: dict[str, Any]) -> None:  # health source thread: {verdict, reasons, detector}
        self.health_q.put(body)
        os.write(self._wake_w, b"x")

    # ---- workers ---------------------------------------------------------
    def _spawn(self, lr: int) -> None:
        worker_env = {**self.env, resild_env.LOCAL_RANK.name: str(lr), "LOCAL_RANK": str(lr)}
        proc = subprocess.Popen(self.cmd, env=worker_env, preexec_fn=die_with_parent, stderr=subprocess.PIPE)
        assert proc.stderr is not None
        src = os.dup(proc.stderr.fileno())  # the tail's own descriptor: Popen's file object goes
        proc.stderr.close()
        proc.stderr = None
        self.workers[lr] = Worker(lr, proc, os.pidfd_open(proc.pid), OutputTail(src))

    def _kill_workers(self, sig: int = signal.SIGKILL) -> None:
        for w in self.workers.values():
            if w.proc.poll() is None:
                try:
                    os.kill(w.proc.pid, sig)
                except ProcessLookupError:
                    pass
        for w in self.workers.values():
            w.proc.wait()

    def _inject(self, body: dict[str, Any]) -> None:
        kind, lr = body.get("kind"), int(body.get("local_rank", 0))
        w = self.workers.get(lr)
        if kind == "nodeloss":
            os.killpg(os.getpgrp(), signal.SIGKILL)
        elif kind in ("kill", "hang") and w is not None:
            os.kill(w.proc.pid, signal.SIGKILL if kind == "kill" else signal.SIGSTOP)
        elif body.get("xid") is not None:
            if self.nvml_control is None:
                log.error("%s: cannot inject Xid: no NVML stand-in configured", self.node)
                return
            with open(self.nvml_control, "a") as f:
                f.write(f"event {lr} xid {int(body['xid'])}\n")

    # ---- main loop -------------------------------------------------------
    def _qualified(self) -> list[str]:
        """`resild check --qualify` on this node, before it registers (it takes seconds: a
        registered node that long silent would be lost). Its reasons, [] when qualified."""
        args = [sys.executable, "-m", "resild.cli", "check", "--qualify", "--json"]
        if self.nvml_control is not None:
            args += ["--probes", "gpu"]  # a simulated node: its GPU through the NVML stand-in only
        try:
            p = subprocess.run(args, capture_output=True, text=True, timeout=QUALIFY_TIMEOUT_S, env=self.env)
            got = json.loads(p.stdout)
            reasons = [str(r) for r in got.get("qualification") or []]
            qualified = bool(got.get("qualified"))
        except (OSError, ValueError, AttributeError, subprocess.TimeoutExpired) as e:
            return [f"qualification did not run: {e!r}"[:300]]
        finally:
            self.last_word_s = time.monotonic()  # the lease counts from now
        return [] if qualified else reasons or ["not qualified"]

    def run(self) -> int:
        self.relay = RelayServer(self.ctx, self.node)
        self.env[RELAY_ENV] = self.relay.endpoint
        unqualified = self._qualified() if self.qualify else []
        self._register()
        if unqualified:
            # Said as the node's health: the controller drops it from the pool and drains it
            # with the reason; it never starts a worker, and exits when fenced.
            log.error("%s: not qualified: %s", self.node, "; ".join(unqualified))
            self._send_health(
                {
                    "verdict": "failed",
                    "reasons": [f"not qualified: {r}" for r in unqualified],
                    "detector": Detector.QUALIFY.value,
                }
            )
        else:
            self._start_probe()
        try:
            for lr in range(0 if unqualified else self.nproc):
                self._spawn(lr)
        except OSError as e:
            # A bad command is the user's mistake, the same on every node: stop the job.
            why = f"{self.node}: cannot start the worker command {self.cmd[0]!r}: {e.strerror}"
            self.ch.send(MsgType.FATAL, {"node": self.node, "error": why})
            self.ch.close(linger_ms=2000)
            log.error("%s", why)
            self._kill_workers()
            return 2
        poller = zmq.Poller()
        for sock in self.ch.socks:
            poller.register(sock, zmq.POLLIN)
        poller.register(self.relay.sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        for w in self.workers.values():
            poller.register(w.pidfd, zmq.POLLIN)
        next_hb = next_probe = 0.0
        try:
            while self.exit_code is None:
                now = time.monotonic()
                if now >= next_hb:
                    # skipped for the leader after a recent commit report: the next one is due an
                    # interval after that report, so the leader never waits more than an interval
                    to_leader = self._heartbeat(periodic=True)
                    next_hb = now + self.heartbeat_s if to_leader else self._report_s + self.heartbeat_s
                if self.probe is not None and now >= next_probe:
                    self._poll_probe()
                    next_probe = now + self.probe_interval_s
                if self.commits.due(now):
                    self._report_commits(now)
                if self._lease_expired(now):
                    break
                store_due = self.store.next_deadline()
                if now >= store_due:
                    self._store_replies(self.store.expire(now))
                    store_due = self.store.next_deadline()
                wake = min(next_hb, self.commits.next_due_s() or next_hb, store_due)
                timeout_ms = max(1, int((wake - time.monotonic()) * 1000))
                for fd, _ in poller.poll(timeout_ms):
                    if (index := self.ch.index_of(fd)) is not None:
                        self._drain_socket(index)
                    elif fd is self.relay.sock:
                        self._drain_relay()
                    elif fd == self._wake_r:
                        os.read(self._wake_r, 4096)
                        while not self.health_q.empty():
                            self._send_health(self.health_q.get())
                    else:
                        self._reap(fd, poller)
                if self.shutting_down_until is not None:
                    alive = [w for w in self.workers.values() if w.proc.poll() is None]
                    if not alive or time.monotonic() > self.shutting_down_until:
                        if alive:
                            log.warning("%s: killing %d worker(s) still running after shutdown", self.node, len(alive))
                        self._kill_workers()
                        self.exit_code = 0
        finally:
            self._kill_workers()
            if self.probe is not None:
                self.probe.stop()
            self.relay.close()
            self.ch.close()
            self.ctx.term()
        assert self.exit_code is not None  # the loop ends only once it is set
        return self.exit_code

    # ---- relay: membership down, progress up ----------------------------------
    def _heartbeat(self, resync: bool = False, periodic: bool = False) -> bool:
        """Heartbeat every replica (the leader too, unless `periodic` and a commit report has
        just told it we are alive); True when the leader got it."""
        body: dict[str, Any] = {"node": self.node, "epoch": self.layout.epoch, "pid": os.getpid()}
        relayed = sorted(self.relay.workers) if self.relay is not None else []
        if relayed != self._relayed_sent:  # only on change: the controller keeps it
            body["relayed"] = relayed
            self._relayed_sent = relayed
        if resync:
            body["resync"] = True
        news = not periodic or resync or "relayed" in body or self.layout.epoch != self._epoch_sent
        if self.ch.leader is not None and not leader_heartbeat_due(
            time.monotonic(), self._report_s, self.heartbeat_s, news
        ):
            self.ch.send_standbys(MsgType.HEARTBEAT, body, ttl_s=5)
            return False
        self._epoch_sent = self.layout.epoch
        self.ch.send_all(MsgType.HEARTBEAT, body, ttl_s=5)  # a standby taking over hears every node at once
        return True

    def _register(self) -> None:
        self.ch.send_all(MsgType.REGISTER_NODE, {"node": self.node, "pid": os.getpid(), "nproc": self.nproc})

    def _new_leader(self, lease: dict[str, Any]) -> None:
        """A new (or restarted) controller leads: tell it who we are, what we hold and
        what it missed (workers that exited), and point our workers at it."""
        log.warning(
            "%s: controller leader is now %s (term %s, pid %s on %s)",
            self.node,
            self.ch.leader_endpoint,
            lease.get("term"),
            lease.get("pid"),
            lease.get("host"),
        )
        self._register()
        self._relayed_sent = None  # the new leader learns which ranks we relay
        self._report_s = -1e9  # a report the old leader got is no heartbeat to the new one
        self._heartbeat()
        for body in self.exited:
            self.ch.send(MsgType.WORKER_EXIT, body)
        if self.health is not None and self.health.get("verdict") != "healthy":
            # A verdict the old leader got and died before acting on (seen: an Xid 79 sent
            # to a leader killed a moment later; its successor let the bad GPU train on).
            self.ch.send(MsgType.HEALTH, {"node": self.node, **self.health})
        if self.relay is not None:
            self._store_replies(self.store.leader_changed())  # the new leader never saw them
            self.relay.broadcast(MsgType.LEASE, lease)

    def _on_membership(self, msg: Message) -> None:
        if msg.type == MsgType.MEMBERSHIP:
            fresh: bool | None = self.layout.on_layout(msg.body)
        else:
            fresh = self.layout.on_delta(msg.body)
        if fresh is None:
            self._heartbeat(resync=True)  # missed an epoch: the controller sends our view again
        elif fresh:
            m = self.layout.membership
            assert m is not None and self.relay is not None
            self.commits.expected = max(1, len(m.node_ranks.get(self.node, ())))
            self.relay.set_membership(m)

    def _drain_relay(self) -> None:
        assert self.relay is not None
        for _ in range(1000):  # bounded: the controller socket is served too
            got = self.relay.recv()
            if got is None:
                return
            ident, msg = got
            if msg.type == MsgType.RELAY_HELLO:
                self._heartbeat()  # tell the controller this rank no longer needs direct sends
            elif msg.type == MsgType.STORE:
                replies, forward = self.store.request(ident, msg.body, time.monotonic())
                self._store_replies(replies)
                if forward is not None:  # lives as long as its own timeout, as the worker's does
                    ttl_s = forward["timeout_s"] + 1.0
                    self.ch.send(MsgType.STORE, {**forward, "node": self.node}, ttl_s=ttl_s)
            elif msg.type == MsgType.PROGRESS:
                self._on_progress(msg.body)
            else:  # anything else is the controller's business, unchanged
                self.ch.send(msg.type, {**msg.body, "node": self.node})

    def _store_replies(self, replies: list[tuple[bytes, dict[str, Any]]]) -> None:
        assert self.relay is not None
        for ident, body in replies:
            self.relay.ch.send(MsgType.STORE_REPLY, body, to=ident)

    def _on_progress(self, b: dict[str, Any]) -> None:
        now = time.monotonic()
        state = b.get("state")
        if state == "commit":
            try:
                paced, of = b.get("paced_s"), b.get("of")
                self.commits.add(
                    int(b["rank"]),
                    int(b["epoch"]),
                    int(b["step"]),
                    now,
                    float(paced) if isinstance(paced, (int, float)) and not isinstance(paced, bool) else None,
                    of if isinstance(of, int) and not isinstance(of, bool) and of > 0 else None,
                )
            except (KeyError, TypeError, ValueError):
                log.warning("%s: bad progress from a worker: %r", self.node, b)
            if self.commits.due(now):
                self._report_commits(now)
            return
        # Any other state (wait, compute, collective_failed, ...) goes on at once, after the
        # pending commits, so the controller sees each rank's reports in order.
        self._report_commits(now)
        self.ch.send(MsgType.PROGRESS, {**b, "node": self.node})

    def _report_commits(self, now: float) -> None:
        body = self.commits.take(now)
        if body is not None:
            self.ch.send(MsgType.PROGRESS, {"node": self.node, **body})
            if self.ch.leader is not None:
                self._report_s = now

    def _poll_probe(self) -> None:
        assert self.probe is not None
        body = self.probe.poll()
        if body is not None:  # None: no daemon and no probe applies here (e.g. no NVML)
            self._send_health(body)

    def _send_health(self, body: dict[str, Any]) -> None:
        self.health = body  # the newest verdict: a new leader hears it again (_new_leader)
        self.ch.send(MsgType.HEALTH, {"node": self.node, **body})

    def _lease_expired(self, now: float) -> bool:
        if self.lease_timeout_s <= 0 or self.shutting_down_until is not None:
            return False  # told to shut down: the controller is gone on purpose, workers finish
        timeout_s = self.lease_timeout_s
        silent_s = now - self.last_word_s
        if silent_s <= timeout_s:
            return False
        endpoint = self.ch.leader_endpoint
        self._kill_workers()
        # Under Slurm, release the allocation (launcher/node/lease.py): a lost controller is usually a
        # dead batch host, and Slurm would hold the job's other nodes until its time limit.
        released = ""
        job_id = lease.slurm_job_id(os.environ, self.node)
        if job_id is not None:
            mode, note = lease.mode_from_env(os.environ)
            # the requeue/scancel makes slurmstepd TERM this step: finish and say what happened first
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            released = "; " + lease.release(
                job_id, f"controller lost (no word from {endpoint} for {silent_s:.1f}s; batch host down?)", mode
            )
            if note:
                released += f" ({note})"
        say(  # one write: every node process of the job says this at once, on one stderr
            f"resild node {self.node}: no word from the controller at {endpoint} for {silent_s:.1f}s "
            f"(--controller-timeout {timeout_s:g}s): stopped {len(self.workers)} worker(s){released}; "
            f"exit {CONTROLLER_LOST_EXIT}"
        )
        self.exit_code = CONTROLLER_LOST_EXIT
        return True

    def _drain_socket(self, index: int) -> None:
        while (msg := self.ch.recv(index)) is not None:
            if msg.type == MsgType.LEASE and self.ch.follow(
                int(msg.body.get("term", 0)), int(msg.body.get("leader", index))
            ):
                self._new_leader(msg.body)
            if index != self.ch.leader:
                continue  # an older term's leader: not ours any more
            self.last_word_s = time.monotonic()  # any word from the leader renews the lease
            if msg.type == MsgType.FENCE:
                log.warning("%s fenced: %s", self.node, msg.body.get("reason"))
                self._kill_workers()
                self.exit_code = FENCED_EXIT
                return
            if msg.type == MsgType.LEASE:
                timeout_s = msg.body.get("timeout_s")
                if isinstance(timeout_s, (int, float)) and timeout_s > 0:  # validated at decode
                    self.lease_timeout_s = float(timeout_s)
                continue
            if msg.type == MsgType.SHUTDOWN:
                if self.shutting_down_until is None:
                    # Success: workers may still be saving their final state, give them
                    # time. Failure: they are being stopped, do not wait long.
                    ok = int(msg.body.get("exit_code", 1)) == 0
                    self.shutting_down_until = time.monotonic() + (self.exit_grace_s if ok else 5.0)
                    if self.relay is not None:
                        self.relay.broadcast(MsgType.SHUTDOWN, msg.body)
            elif msg.type == MsgType.PING:
                self._heartbeat()
            elif msg.type == MsgType.WELCOME:
                # At scale the controller asks for fewer heartbeats (its budget / nodes).
                floor_s = msg.body.get("heartbeat_s")
                if isinstance(floor_s, (int, float)) and 0 < floor_s <= 60:
                    self.heartbeat_s = max(self.heartbeat_s, float(floor_s))
            elif msg.type in (MsgType.MEMBERSHIP, MsgType.MEMBERSHIP_DELTA):
                self._on_membership(msg)
            elif msg.type == MsgType.STORE_REPLY:
                self._store_replies(self.store.reply(msg.body))
            elif msg.type == MsgType.INJECT:
                self._inject(msg.body)
            elif msg.type == MsgType.ERROR:
                log.error("%s: controller says %s", self.node, msg.body)

    @staticmethod
    def _mismatch(w: Worker, rc: int) -> str | None:
        """What the worker's last output says of a collective mismatch. A backend's abort
        (SIGABRT) may still have its last words in the pipe: then wait for them, briefly."""
        if w.out is None or rc == 0:
            return None
        line = mismatch_line(w.out.text())
        if line is None and rc == -signal.SIGABRT:
            line = mismatch_line(w.out.text(wait_s=0.5))
        return line

    def _reap(self, fd: int, poller: zmq.Poller) -> None:
        for w in self.workers.values():
            if w.pidfd == fd:
                rc = w.proc.wait()
                poller.unregister(fd)
                os.close(fd)
                if self.relay is not None:
                    self.relay.forget(w.local_rank)
                body: dict[str, Any] = {
                    "node": self.node,
                    "local_rank": w.local_rank,
                    "pid": w.proc.pid,
                    "returncode": rc,
                }
                line = self._mismatch(w, rc)
                if line is not None:  # killed from inside the backend: its last words say why
                    body["collective_mismatch"] = line
                self.exited.append(body)
                self.ch.send(MsgType.WORKER_EXIT, body)
                return


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launcher.node", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--node", default=os.environ.get("SLURMD_NODENAME"), help="this node's name (default: $SLURMD_NODENAME)"
    )
    p.add_argument("--controller", required=True)
    p.add_argument("--keys")
    p.add_argument("--nproc", type=int, required=True)
    p.add_argument(
        "--settings",
        type=_settings,
        default=None,
        help="the job's settings as JSON (resil-run's JobSettings; default: its defaults): heartbeat "
        "interval, and the lease (exit 75 after controller_timeout_s without a word from the controller)",
    )
    p.add_argument("--nvml-control", type=Path)
    p.add_argument(
        "--qualify", action="store_true", help="run `resild check --qualify` before registering (a node that joined)"
    )
    p.add_argument(
        "--replace-stale",
        action="store_true",
        help="first kill what is left of this node's earlier node process in the same Slurm job (a re-admission)",
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    if not a.node:
        p.error("--node is required outside Slurm")
    if not cmd:
        p.error("no worker command given after --")
    logging.basicConfig(level=logging.INFO, format=f"[{a.node}] %(message)s")
    die_with_parent()
    if a.replace_stale:
        sweep(a.node)
    keys = KeyDir(Path(a.keys)) if a.keys else None
    return NodeProcess(
        a.node,
        a.controller,
        keys,
        a.nproc,
        cmd,
        a.settings,
        a.nvml_control,
        qualify=a.qualify,
    ).run()


def _settings(text: str) -> JobSettings:
    try:
        return JobSettings.from_dict(json.loads(text))
    except (ValueError, TypeError) as e:  # json.JSONDecodeError and SettingsError are ValueErrors
        raise argparse.ArgumentTypeError(str(e)) from None


if __name__ == "__main__":
    sys.exit(main())
