"""Standby controllers: N replicas of the controller, one leading, the journal replicated
in etcd, so losing the leader's host loses no decision.

    python -m resild.controller.replica --spec RUN_DIR/controllers.json --index I

A replica (a spec with `etcd`: resild.controller.etcd_target.EtcdTarget as a dict, and
`lease_ttl_s`) binds its ROUTER endpoint at start (the rendezvous keys live in the
leader), stands by following the journal and draining its socket (node processes
heartbeat every replica, so the socket is warm), campaigns for the leader key when nobody
holds it (resild.controller.etcd_election), leads with the journal written in
transactions guarded by that key (resild.controller.etcd_journal): it first commits a
`leader` record, rebuilds the controller's state from the journal
(`Controller.restore`) and leases every node with a higher term; nodes and workers follow
the highest term, register again, and their store requests go to this replica. When
deposed it stands by again on the same endpoint (`serve_etcd`).

The spec (JSON, written by resil-run): active, spares, nproc, endpoints (ROUTER, one per
replica), etcd, keys, events, run_dir, faults, and the job's settings (`settings`:
resild.wire.settings.JobSettings as a dict, validated again here).

(`--consensus raft`, a pysyncobj replica set whose frames were pickles, was removed: one
consensus engine, the one held to the security standard, issue 39.)
"""

from __future__ import annotations

import argparse
import enum
import json
import logging
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

import resild.slurm as slurm
import resild.wire.env as resild_env
from resild.controller import verdict_file
from resild.controller.backend import Backend, SlurmDrain
from resild.controller.etcd_client import Etcd, EtcdError
from resild.controller.etcd_election import Election
from resild.controller.etcd_journal import EtcdJournal, Follower
from resild.controller.etcd_target import EtcdTarget
from resild.controller.faults import parse_fault
from resild.controller.journal import Journal
from resild.controller.loop import Controller, ControllerConfig, ControllerFailed
from resild.controller.records import Closed, Leader
from resild.controller.view import JobResult
from resild.events.log import EventLog
from resild.events.schema import EventName
from resild.procutil import die_with_parent, say
from resild.wire.channel import Server
from resild.wire.keys import KeyDir
from resild.wire.settings import JobSettings

log = logging.getLogger("resild.replica")

RUNNER_ALIVE = "runner.alive"  # resil-run touches it while it waits (Slurm: its host may die)


CLOSED = Closed.ACTION  # the leader's last record: the job is over and its verdict written


def _closed(records: list[dict[str, Any]]) -> bool:
    # Not only the last record: a standby elected as the leader went learns of the commit
    # with its own `leader` record, which lands after it.
    return any(r.get("action") == CLOSED for r in reversed(records))


class ProcessNodes(Backend):
    """Node processes on this host that are not our children (resil-run started them;
    each leads its own process group): fence = kill the group, exits seen through
    pidfds. Pids come from the nodes' registrations and heartbeats."""

    def __init__(self, pid_of: Callable[[str], int | None], nodes: list[str]) -> None:
        self.pid_of, self.nodes = pid_of, nodes
        self._fds: dict[str, int] = {}
        self._done: set[str] = set()

    def fence(self, node: str, reason: str) -> None:
        self._done.add(node)
        pid = self.pid_of(node)
        if pid:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def exited_nodes(self) -> list[tuple[str, int]]:
        out = []
        for node in self.nodes:
            if node in self._done or node in self._fds or not (pid := self.pid_of(node)):
                continue
            try:
                self._fds[node] = os.pidfd_open(pid)
            except ProcessLookupError:
                self._done.add(node)
                out.append((node, -1))
        if self._fds:
            ready, _, _ = select.select(list(self._fds.values()), [], [], 0)
            for node, fd in list(self._fds.items()):
                if fd in ready and node not in self._done:
                    self._done.add(node)
                    os.close(self._fds.pop(node))
                    out.append((node, -1))  # not our child: no exit status to read
        return out

    def shutdown(self, timeout_s: float) -> None:
        self._done.update(self.nodes)  # resil-run waits for and reaps the node processes


def discover(spec: dict[str, Any], index: int, run_dir: Path, router_port: int, timeout_s: float = 120.0) -> list[str]:
    """Under Slurm every replica picks its own ports on its own host and publishes them
    in the (shared) run directory; all replicas and resil-run wait for the full set.
    The ROUTER is bound before its port is published: a peer connecting to a port
    nobody listens on yet can end up connected to itself (TCP self-connect) for good."""
    host = spec.get("advertise") or os.environ.get(resild_env.CONTROLLER_HOST.name) or socket.getfqdn()
    mine = {"endpoint": f"tcp://{host}:{router_port}"}
    tmp = run_dir / f".replica-{index}.json.tmp"
    tmp.write_text(json.dumps(mine))
    os.replace(tmp, run_dir / f"replica-{index}.json")
    return wait_for_replicas(run_dir, replica_count(spec), timeout_s)


def replica_count(spec: dict[str, Any]) -> int:
    return len(spec.get("hosts") or []) or int(spec.get("replicas") or 0)


def wait_for_replicas(run_dir: Path, n: int, timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = [json.loads((run_dir / f"replica-{i}.json").read_text()) for i in range(n)]
            return [g["endpoint"] for g in got]
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"controller replicas did not all start within {timeout_s:.0f}s (see {run_dir}/replica-*.json)"
                ) from None
            time.sleep(0.1)


def _mtime_ns(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def runner_alive(first_ns: int | None, now_ns: int | None) -> bool:
    """Whether resil-run is alive, from RUNNER_ALIVE's mtime when the leader first looked
    and now: alive only if it touched the file since. A recent mtime alone says nothing:
    a batch host that crashed a second before the job ended left one (the leader then
    waited on a resil-run that was gone, and the allocation outlived the job)."""
    return now_ns is not None and now_ns != first_ns


def end_orphaned_job(run_dir: Path, result: Any, stale_s: float = 10.0) -> None:
    """The job is over but resil-run (the batch script) is gone with its host: Slurm would
    hold the allocation until the time limit. End it: requeue a failed job (the reason
    in its comment), cancel a finished one. resil-run touches RUNNER_ALIVE every 0.25 s
    until its replicas are gone: untouched for `stale_s`, it is gone."""
    job_id = os.environ.get("SLURM_JOB_ID")
    alive = run_dir / RUNNER_ALIVE
    first = _mtime_ns(alive)
    deadline = time.monotonic() + stale_s
    while time.monotonic() < deadline:
        if runner_alive(first, _mtime_ns(alive)):
            return
        time.sleep(0.1)
    if not job_id:
        return
    what = "finished" if result.exit_code == 0 else "failed"
    say(
        f"resild controller: the job {what} ({result.reason}) but resil-run is gone (batch host lost?): "
        f"{'cancelling' if result.exit_code == 0 else 'requeuing'} job {job_id}"
    )
    # a failed job goes back in the queue (the reason in its comment), a finished one ends
    mode = "requeue" if result.exit_code != 0 else "cancel"
    log.warning("%s", slurm.release_job(job_id, f"{result.reason} (batch host lost)", mode))


@dataclass(frozen=True)
class TakeOver:
    """A replica just elected: who it is and what the journal holds."""

    spec: dict[str, Any]
    index: int
    endpoint: str
    term: int
    t_elected: float  # time.monotonic() when the election was won
    journal: list[dict[str, Any]]  # every record committed so far

    @property
    def cluster(self) -> bool:
        return bool(self.spec.get("hosts"))

    @property
    def records(self) -> list[dict[str, Any]]:
        """The job's records: the journal without the replicas' own (leader, closed)."""
        return [r for r in self.journal if r.get("action") not in (Leader.ACTION, CLOSED)]


def lead(
    taken: TakeOver,
    keys: KeyDir | None,
    ctx: zmq.Context[Any],
    server: Server,
    journal: Journal,
    leadership: Callable[[], bool],
    resuming: bool = False,
    failed: Callable[[], None] = lambda: None,
) -> tuple[Controller, JobResult]:
    """The take-over: the controller rebuilt from the journal (or, for
    resil-run --resume, the job started again from it), its leadership said in the event log,
    then the job run to its verdict, or the verdict said again if the job had ended when the
    old leader died. A ControllerFailed (the controller's own failure) calls `failed` first."""
    spec, records = taken.spec, taken.records
    events = EventLog(Path(spec["events"]))
    cfg = ControllerConfig(
        bind=taken.endpoint,
        settings=JobSettings.from_dict(spec["settings"]),
        term=taken.term,
        leader_index=taken.index,
        # Under Slurm nothing else tells us the node processes are gone
        # (their workers may still be saving) before we end the allocation.
        wait_nodes_gone_s=2.0 if taken.cluster else 0.0,
    )
    nodes = list(spec["active"]) + list(spec["spares"])
    ctl = Controller(
        cfg,
        list(spec["active"]),
        list(spec["spares"]),
        int(spec["nproc"]),
        keys,
        events,
        journal,
        None,
        [parse_fault(f) for f in spec.get("faults", [])],
        ctx=ctx,
        server=server,
        leadership=leadership,
    )
    ctl.backend = SlurmDrain() if taken.cluster else ProcessNodes(_host_pid_of(ctl), nodes)
    if resuming:
        ctl.resume(records)
    elif records:
        ctl.restore(records, time.monotonic())
    events.emit(
        EventName.CONTROLLER_LEADER,
        pid=os.getpid(),
        host=socket.gethostname(),
        term=taken.term,
        index=taken.index,
        endpoint=taken.endpoint,
        restored=len(records),
        elected_s=round(time.monotonic() - taken.t_elected, 4),
    )
    if ctl.result is not None:  # the job had ended when the old leader died: say so again
        result = ctl.result
        ctl.finish()
    else:
        try:
            result = ctl.run()
        except ControllerFailed:
            events.close()
            failed()
            raise
    events.close()
    return ctl, result


def say_verdict(taken: TakeOver, result: JobResult) -> None:
    """The leader's verdict, for resil-run (the run directory) and, under Slurm, for the
    allocation when resil-run is gone."""
    run_dir = Path(taken.spec["run_dir"])
    verdict_file.write(run_dir, taken.index, result.exit_code, result.reason)
    if taken.cluster:
        end_orphaned_job(run_dir, result)


def serve(spec: dict[str, Any], index: int) -> int:
    run_dir = Path(spec["run_dir"])
    verdict_file.reserve(run_dir, index)  # room for the verdict, whatever fills the disk later
    keys = KeyDir(Path(spec["keys"])) if spec.get("keys") else None
    ctx = zmq.Context()
    cluster = bool(spec.get("hosts"))
    if "etcd" not in spec:  # a spec of an older resil-run (--consensus raft, removed)
        say(f"resild controller replica {index}: the spec has no etcd: this replica set cannot run")
        return 2
    if "endpoints" not in spec:  # ports chosen here, published in the run directory
        server = Server(ctx, f"tcp://{'*' if cluster else spec.get('advertise', '127.0.0.1')}:0", keys)
        endpoints = discover(spec, index, run_dir, int(server.endpoint.rsplit(":", 1)[1]))
    else:
        endpoints = list(spec["endpoints"])
        server = Server(ctx, endpoints[index], keys)
    return serve_etcd(spec, index, ctx, server, endpoints[index])


def _host_pid_of(ctl: Controller) -> Callable[[str], int | None]:
    return lambda node: ctl.view.nodes[node].host_pid


STANDBY_POLL_S = 0.05  # a standby reads the journal and looks for a leader this often


class Standing(enum.Enum):
    LEADER = "leader"  # this replica won the election
    CLOSED = "closed"  # the job is over: nothing to take over


def stand_by(server: Server, follower: Follower, election: Election, index: int) -> Standing:
    """Drain the socket, follow the journal, and campaign whenever nobody leads."""
    quiet_until = next_poll = 0.0
    while True:
        # standby: keep the socket drained (every node heartbeats every replica), act on nothing
        server.channel.recv(max(0.0, next_poll - time.monotonic()))
        if time.monotonic() < next_poll:
            continue
        next_poll = time.monotonic() + STANDBY_POLL_S
        try:
            if election.term is None:  # (not yet won: a win whose read failed is not lost)
                follower.poll()
                if _closed(follower.records):  # the leader finished the job and stood down
                    return Standing.CLOSED
                if election.leader() is not None or not election.campaign():
                    continue
            follower.poll()  # every record the last leader committed, before we act
            if _closed(follower.records):  # elected as the old leader stood down: nothing to lead
                election.resign()
                return Standing.CLOSED
            return Standing.LEADER
        except EtcdError as e:
            if time.monotonic() >= quiet_until:  # one line per 10 s while etcd is away
                log.warning("replica %d: etcd: %s", index, e)
                quiet_until = time.monotonic() + 10.0


def serve_etcd(spec: dict[str, Any], index: int, ctx: zmq.Context[Any], server: Server, endpoint: str) -> int:
    """The replica with etcd: stand by, lead when elected, stand by again when deposed."""
    run_dir = Path(spec["run_dir"])
    keys = KeyDir(Path(spec["keys"])) if spec.get("keys") else None
    target = EtcdTarget.from_dict(spec["etcd"])
    etcd = Etcd(target)
    follower = Follower(etcd, target.prefix, run_dir / f"journal-{index}.jsonl")
    election = Election(etcd, target.prefix, index, os.getpid(), ttl_s=int(spec.get("lease_ttl_s", 1)))
    log.info("replica %d: standing by (%s, etcd %s)", index, endpoint, ",".join(target.endpoints))
    while True:
        if stand_by(server, follower, election, index) is Standing.CLOSED:
            server.close()
            follower.close()
            return 0
        t_elected = time.monotonic()
        term = election.term
        journal = EtcdJournal(etcd, target.prefix, election, follower)
        if term is None or not journal.write(Leader(index, os.getpid(), time.time()).to_dict()):
            log.warning("replica %d: elected but could not commit: %s", index, journal.last_error)
            election.resign()
            continue
        say(f"resild controller replica (pid {os.getpid()}): leader (term {term}) at t_mono {time.monotonic():.3f}")
        # resil-run --resume: the first leader of the new run starts the job again from the
        # journal; a later one takes over from it as usual.
        at = spec.get("resume_records")
        resuming = at is not None and all(r.get("action") == Leader.ACTION for r in follower.records[int(at) :])
        taken = TakeOver(spec, index, endpoint, term, t_elected, follower.records)

        def failed() -> None:
            # Our own failure, not the job's: no verdict, nobody told to shut down. The lease
            # goes now (a standby leads at once, not when it expires) and we exit.
            election.resign()
            follower.close()

        ctl, result = lead(taken, keys, ctx, server, journal, election.holds, resuming=resuming, failed=failed)
        if ctl.deposed:  # another replica leads now: stand by again, on the same socket
            election.resign()
            say(f"resild controller replica (pid {os.getpid()}): deposed at t_mono {time.monotonic():.3f}; standing by")
            continue
        server.close()
        say_verdict(taken, result)
        # Tell the standbys the job is over, or they elect one of themselves the moment we go
        # (which would say the verdict again, late). Not committed: they take over, which is
        # right, since nodes might still need the SHUTDOWN.
        if not journal.write(Closed(index, time.time()).to_dict()):
            log.warning("replica %d: could not tell the standbys the job is over: %s", index, journal.last_error)
        election.resign()
        follower.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m resild.controller.replica",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--spec", required=True, type=Path, help="the replica set's JSON spec (written by resil-run)")
    p.add_argument(
        "--index",
        type=int,
        help="this replica's place in the spec's lists (default under Slurm: $SLURMD_NODENAME's "
        "place in the spec's hosts)",
    )
    a = p.parse_args(argv)
    try:
        spec = json.loads(a.spec.read_text())
    except (OSError, ValueError) as e:
        p.error(f"cannot read --spec {a.spec}: {e}")
    if a.index is None and spec.get("hosts"):
        node = os.environ.get("SLURMD_NODENAME", "")
        a.index = spec["hosts"].index(node) if node in spec["hosts"] else None
    n = replica_count(spec) or len(spec.get("endpoints") or [])
    if a.index is None or not 0 <= a.index < n:
        p.error(f"--index {a.index} is not a replica of {a.spec}")
    # Our own log in the (shared) run directory: under Slurm our stderr goes to srun on the
    # batch host, which may be the host that dies; resil-run's terminal shows the leader
    # changes from the event file.
    log_file = open(Path(spec["run_dir"]) / f"replica-{a.index}.log", "a", buffering=1)
    os.dup2(log_file.fileno(), 2)
    sys.stderr = log_file
    logging.basicConfig(
        level=logging.INFO if os.environ.get(resild_env.DEBUG.name) else logging.WARNING,
        format=f"[controller {a.index}] %(asctime)s %(message)s",
    )
    die_with_parent()
    return serve(spec, a.index)


if __name__ == "__main__":
    sys.exit(main())
