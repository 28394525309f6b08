"""Control plane at scale: the real controller against N simulated nodes x P ranks.

    python bench/controller_scale.py                      # N = 250, 1000, 2000, 4000 x 8, a table
    python bench/controller_scale.py --nodes 250 --json   # one JSON object per line, one line per N

Group formation (the controller's store path, the node stores, TCPStore side by side) is
bench/rendezvous_scale.py's.

The controller runs in its own process exactly as under resil-run (ROUTER socket,
CURVE on, journal with fsync, the policy), with a no-op scheduler backend. Load
generator processes each hold one DEALER per simulated node process (CURVE, its
own identity), and speak the node's protocol: REGISTER_NODE, one REGISTER_WORKER
per local rank (sent over the node's connection: the same handler and message
count as a worker's own connection, without 16k more TCP connections on a
2-core machine), HEARTBEAT every --heartbeat-s, and one aggregated commit
report per node per step (what launcher/node/relay.py sends). A simulated node holds
the epoch it was sent (its view or a delta; a delta that does not apply makes it
ask for its view again, as a node process does).

Measured, per N:
- register_s: first registration sent -> the controller has every worker (epoch 1 decided).
- decide_s: a node's WORKER_EXIT sent -> the controller's decision (failure_detected).
- announce_s: decision -> the new epoch held by every worker: the slowest simulated node
  to hold it, plus the node-local relay hop to its P workers (measured with the real
  RelayServer and P RelayClients over ipc, a layout of the same size; every node does
  this hop in parallel on its own host). announce_ctl_s: controller time spent encoding
  and sending the announcement.
- cpu_per_s: controller process CPU seconds per second (all its threads, CURVE included)
  in steady state at --steps-per-s with heartbeats every --heartbeat-s, or less often
  where the controller's heartbeat budget says so (--heartbeat-budget 0: never).
Also in --json: the CPU parts (register_cpu_s, announce_cpu_s, cpu_main_per_s), the
decision's journal fsync, the messages/s actually sent and the machine's load average,
since every latency here is wall clock on a machine the generators share.

The slowest simulated node is an upper bound: the 2,000 receivers share the machine's
cores with the controller (on a cluster each is on its own host). What the receiving
cost is in --json: announce_first_s and announce_spare_s (the first node, and the spare,
to hold the epoch), and the CPU the controller and the generators spent while the
failure was handled (announce_window_*_cpu_s, from the scheduler's per-thread
nanosecond counters where Linux has them). --failures K fails K
nodes one after the other (a spare each) and reports medians; each failure is injected
mid-step (--inject-phase), away from the burst of every node's commit report.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import multiprocessing as mp
import os
import resource
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq

from resild.wire.protocol import MsgType, Sequencer, encode

NODES_PER_GENERATOR = 1000


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _int_opt(sock: zmq.Socket[Any], opt: int) -> int:
    """An integer socket option (FD, EVENTS): pyzmq types every option as int | bytes."""
    v = sock.getsockopt(opt)
    assert isinstance(v, int)
    return v


def _keys_for(keys_dir: str, node: str) -> Any:
    from resild.wire.keys import KeyDir

    keys = KeyDir(Path(keys_dir))
    # Per-node keys where the transport has them (each node's key may speak only for it).
    return keys.node(node) if hasattr(keys, "node") and (keys.path / "nodes" / node).exists() else keys


def _cpu_s(proc: Any) -> dict[str, float]:
    """A process's CPU seconds by thread kind: "main" (the controller's Python thread),
    "zmq" (libzmq's I/O threads: CURVE, the sockets' writes and reads) and "other"; from the
    scheduler's nanosecond counters where Linux has them (a failure is handled in tens of
    ms; psutil's clock ticks are 10 ms)."""
    out = {"main": 0.0, "zmq": 0.0, "other": 0.0}
    try:
        tids = os.listdir(f"/proc/{proc.pid}/task")
    except OSError:
        t = proc.cpu_times()
        out["other"] = float(t.user + t.system)
        return out
    for tid in tids:
        try:
            ns = int(Path(f"/proc/{proc.pid}/task/{tid}/schedstat").read_text().split()[0])
            comm = Path(f"/proc/{proc.pid}/task/{tid}/comm").read_text().strip()
        except (OSError, ValueError, IndexError):
            continue  # a thread that ended meanwhile
        kind = "main" if int(tid) == proc.pid else "zmq" if comm.startswith("ZMQbg/IO") else "other"
        out[kind] += ns / 1e9
    return out


# ---- the controller process ----------------------------------------------------------------


def controller_main(cfg: dict[str, Any], out: Any, stop: Any, ended: Any) -> None:
    _raise_fd_limit()
    from resild.controller.backend import Backend
    from resild.controller.journal import Journal
    from resild.controller.loop import Controller, ControllerConfig, JobResult
    from resild.controller.records import Record
    from resild.events.log import EventLog
    from resild.wire.keys import KeyDir
    from resild.wire.settings import JobSettings

    class TimedJournal(Journal):  # the decision includes its fsync: report it apart
        fsync_s: list[float] = []

        def append(self, record: Record) -> bool:
            t = time.perf_counter()
            durable = super().append(record)
            self.fsync_s.append(time.perf_counter() - t)
            return durable

    events = EventLog(None)
    ccfg = ControllerConfig(
        bind="tcp://127.0.0.1:0",
        settings=JobSettings(
            heartbeat_timeout_s=cfg["heartbeat_timeout_s"],
            hang_timeout_s=cfg["hang_timeout_s"],
            start_timeout_s=600.0,
            heartbeat_budget_per_s=cfg["heartbeat_budget"],
            # leases as resil-run's default, kept above the heartbeat timeout (the settings nest)
            controller_timeout_s=max(5.0, 2.5 * cfg["heartbeat_timeout_s"]),
        ),
    )
    ctl = Controller(
        ccfg,
        cfg["active"],
        cfg["spares"],
        cfg["nproc"],
        KeyDir(Path(cfg["keys"])),
        events,
        TimedJournal(Path(cfg["journal"])),
        Backend(),
    )
    out.put(("endpoint", ctl.endpoint))

    asked = threading.Event()

    def stopper() -> None:
        # A pipe, not an Event: a process that exits while waiting on a multiprocessing
        # Event leaves a sleeper that the driver's set() then waits for forever.
        try:
            stop.recv()
        except EOFError:
            pass
        asked.set()
        ctl.result = JobResult(0, "bench over")

    threading.Thread(target=stopper, daemon=True).start()
    if os.environ.get("RESILD_BENCH_PROFILE"):  # where the controller's time goes
        import cProfile

        cProfile.runctx("ctl.run()", globals(), {"ctl": ctl}, os.environ["RESILD_BENCH_PROFILE"])
    else:
        ctl.run()
    ended.set()  # before the events go out: a queue's feeder holds the process until they are read
    if ctl.result is not None and ctl.result.exit_code != 0 and not asked.is_set():
        print(f"controller_scale: the controller stopped the job: {ctl.result.reason}", file=sys.stderr, flush=True)
    keep = ("membership", "failure_detected", "spare_assigned", "node_fenced")
    recs = []
    for e in events.records:
        if e["event"] in keep:
            recs.append({k: v for k, v in e.items() if k != "layout"})
    out.put(("events", recs, TimedJournal.fsync_s))


# ---- a load generator process --------------------------------------------------------------


@dataclass
class SimNode:
    name: str
    sock: zmq.Socket[Any]
    seq: Sequencer
    epoch: int = 0
    alive: bool = True
    hb_s: float = 0.25
    last_report_s: float = -1e9  # its last commit report (a heartbeat too, with reports_beat)


@dataclass
class Awaiting:
    """An epoch the driver waits for: the nodes still without it, and what waiting cost us
    (this generator's own CPU, so that its share of a latency can be told apart)."""

    epoch: int
    want: list[str]
    left: set[str]
    deadline: float
    cpu0: float
    watch: list[str]  # nodes whose own times the driver wants (the spare)


def generator_main(
    gid: int,
    nodes: list[str],
    nproc: int,
    first_rank: dict[str, int],
    keys_dir: str,
    endpoint: str,
    hb_s: float,
    steps_per_s: float,
    reports_beat: bool,
    conn: Any,
) -> None:
    """Every loop iteration is O(ready sockets), never O(nodes): a scan of 1,000 simulated
    nodes per poll was the generator's own cost, and it showed up as announcement time.
    So is zmq.Poller (0.76 ms per call over 1,000 sockets, even with nothing to read): the
    sockets' notification fds sit in one epoll instead. A zmq fd only says "look at
    EVENTS", and a send may consume that notice: after every send the socket is looked at
    again (`dirty`), and once a second all of them are (never needed so far; cheap)."""
    _raise_fd_limit()
    import select

    from resild.wire.channel import connect

    ctx = zmq.Context(io_threads=1)
    ctx.MAX_SOCKETS = 4 * len(nodes) + 64
    sims: dict[str, SimNode] = {}
    by_fd: dict[int, SimNode] = {}
    ep = select.epoll()
    for name in nodes:
        ch = connect(ctx, endpoint, _keys_for(keys_dir, name), sender=f"{name}/node", watch=False)
        s = SimNode(name, ch.sock, Sequencer(f"{name}/node"), hb_s=hb_s)
        fd = _int_opt(ch.sock, zmq.FD)
        sims[name], by_fd[fd] = s, s
        ep.register(fd, select.EPOLLIN)
    ep.register(conn.fileno(), select.EPOLLIN)
    pid = os.getpid()
    epoch_t: dict[int, dict[str, float]] = {}  # epoch -> node -> when it first held it
    counts = {"sent": 0, "recv": 0}
    awaiting: Awaiting | None = None
    dirty: dict[str, SimNode] = {}  # sent on since their socket was last looked at

    def send(s: SimNode, mtype: MsgType, body: dict[str, Any], ttl_s: float = 10.0) -> None:
        try:
            s.sock.send(encode(s.seq.make(mtype, body, ttl_s)), flags=zmq.NOBLOCK)
            counts["sent"] += 1
        except zmq.Again:
            pass
        dirty[s.name] = s

    def drain(s: SimNode) -> None:
        t_recv = time.monotonic()
        while _int_opt(s.sock, zmq.EVENTS) & zmq.POLLIN:
            on_frame(s, s.sock.recv(zmq.NOBLOCK), t_recv)

    def hold(s: SimNode, epoch: int, now: float) -> None:
        if epoch > s.epoch:
            s.epoch = epoch
            epoch_t.setdefault(epoch, {})[s.name] = now
            if awaiting is not None and epoch >= awaiting.epoch:
                awaiting.left.discard(s.name)

    def on_frame(s: SimNode, frame: bytes, now: float) -> None:
        counts["recv"] += 1
        raw = json.loads(frame)
        t, b = raw["type"], raw["body"]
        if t == "membership":
            hold(s, int(b["epoch"]), now)
        elif t == "membership_delta":
            if int(b["base"]) == s.epoch:
                hold(s, int(b["epoch"]), now)
            elif int(b["epoch"]) > s.epoch:  # missed one: ask for our view again
                send(s, MsgType.HEARTBEAT, {"node": s.name, "epoch": s.epoch, "resync": True}, 5)
        elif t == "welcome" and "heartbeat_s" in b:  # the controller's heartbeat budget
            s.hb_s = max(s.hb_s, float(b["heartbeat_s"]))
        elif t == "fence":
            s.alive = False
        elif t == "ping":
            send(s, MsgType.HEARTBEAT, {"node": s.name, "epoch": s.epoch}, 5)

    def report(a: Awaiting) -> None:
        """When every wanted node held the epoch (inf: one never did), the first, and what
        this generator's process spent meanwhile (CPU seconds)."""
        got = epoch_t.get(a.epoch, {})
        times = [got.get(n, math.inf) for n in a.want]
        cpu_s = time.process_time() - a.cpu0
        watched = {n: got[n] for n in a.watch if n in got}
        conn.send(
            ("epoch", gid, a.epoch, max(times, default=0.0), len(a.left), min(times, default=0.0), cpu_s, watched)
        )

    conn.send(("connected", gid))
    started = False
    t0 = 0.0
    last_step = -1
    next_sweep_s = 0.0
    hb_heap: list[tuple[float, int]] = []
    names = list(sims)
    while True:
        now = time.monotonic()
        if started:
            while hb_heap and hb_heap[0][0] <= now:
                due, i = heapq.heappop(hb_heap)
                s = sims[names[i]]
                if s.alive:
                    if reports_beat and now - s.last_report_s < s.hb_s:
                        # as launcher/node/process.py: a recent commit report was the heartbeat
                        heapq.heappush(hb_heap, (s.last_report_s + s.hb_s, i))
                        continue
                    send(s, MsgType.HEARTBEAT, {"node": s.name, "epoch": s.epoch}, 5)
                    heapq.heappush(hb_heap, (due + s.hb_s, i))
            step = int((now - t0) * steps_per_s) if steps_per_s > 0 else -1
            if step > last_step:  # one aggregated commit report per node per step, as training does
                last_step = step
                for s in sims.values():
                    if s.alive and s.epoch > 0:
                        r0 = first_rank[s.name]
                        commits = {str(r0 + k): step for k in range(nproc)}
                        send(
                            s,
                            MsgType.PROGRESS,
                            {"node": s.name, "epoch": s.epoch, "state": "commit", "commits": commits},
                        )
                        s.last_report_s = now
        if awaiting is not None and (not awaiting.left or now > awaiting.deadline):
            report(awaiting)
            awaiting = None
        while dirty:
            drain(dirty.popitem()[1])
        if now >= next_sweep_s:  # the safety net of the notice rule above
            next_sweep_s = now + 1.0
            for s in sims.values():
                drain(s)
        timeout_s = 0.005 if started else 0.1
        if hb_heap:
            timeout_s = max(0.0, min(timeout_s, hb_heap[0][0] - time.monotonic()))
        for fd, _ in ep.poll(timeout_s):
            if fd != conn.fileno():
                drain(by_fd[fd])
                continue
            cmd = conn.recv()
            if cmd[0] == "go":
                started, t0 = True, time.monotonic()
                for i, name in enumerate(names):
                    s = sims[name]
                    send(
                        s,
                        MsgType.REGISTER_NODE,
                        {"node": name, "pid": pid, "nproc": nproc, "epoch": 0, "relayed": list(range(nproc))},
                    )
                    for lr in range(nproc):
                        send(s, MsgType.REGISTER_WORKER, {"node": name, "local_rank": lr, "pid": pid})
                    heapq.heappush(hb_heap, (t0 + hb_s * (i + 1) / len(names), i))
            elif cmd[0] == "await":
                want = [n for n in cmd[2] if n in sims]
                left = {n for n in want if sims[n].epoch < cmd[1]}
                deadline = time.monotonic() + cmd[3]
                awaiting = Awaiting(cmd[1], want, left, deadline, time.process_time(), list(cmd[4]))
            elif cmd[0] == "inject":
                s = sims[cmd[1]]
                t_fail = time.monotonic()
                send(s, MsgType.WORKER_EXIT, {"node": s.name, "local_rank": 0, "pid": pid, "returncode": -9})
                s.alive = False
                conn.send(("injected", gid, t_fail))
            elif cmd[0] == "counts":
                conn.send(("counts", gid, dict(counts)))
            elif cmd[0] == "stop":
                ep.close()
                for s in sims.values():
                    s.sock.close(linger=0)
                ctx.term()
                return


# ---- the node-local relay hop, measured for real -------------------------------------------


def relay_hop_s(n_nodes: int, nproc: int, repeats: int = 5) -> float:
    """Node process holding epoch E gets a delta -> all its P workers hold E+1 (the layout
    decoded and validated by each): the real RelayServer and RelayClients over ipc."""
    from launcher.node.relay import LayoutTracker, RelayServer
    from launcher.worker.links.relay import RelayClient, wait_for
    from resild.membership import Membership

    ctx = zmq.Context()
    tmp = tempfile.mkdtemp(prefix="resild-bench-")
    srv = RelayServer(ctx, "n0", run_dir=tmp)
    clients = [RelayClient(srv.endpoint, f"n0/w{lr}/1", local_rank=lr, ctx=ctx) for lr in range(nproc)]
    m = Membership.initial([f"n{i}" for i in range(n_nodes)], nproc)
    tracker = LayoutTracker(m.view("n0"))  # a node process holds its view
    deadline = time.monotonic() + 5
    while len(srv.workers) < nproc and time.monotonic() < deadline:
        srv.sock.poll(50)
        while srv.recv() is not None:
            pass
    times = []
    for i in range(min(repeats, n_nodes - 1)):
        new = m.replace(f"n{i + 1}", f"spare{i}")
        delta = new.delta_from(m)
        assert delta is not None  # a node replaced: the layout changed
        t = time.perf_counter()
        tracker.on_delta(delta)
        assert tracker.membership is not None
        srv.set_membership(tracker.membership)
        for c in clients:
            msg = wait_for(c, MsgType.MEMBERSHIP, 5.0)
            got = Membership.from_dict(msg.body) if msg is not None else None
            assert got is not None and got.epoch == new.epoch and got.rank_of("n0", nproc - 1) == nproc - 1
        times.append(time.perf_counter() - t)
        m = new
    for c in clients:
        c.close()
    srv.close()
    ctx.term()
    return sorted(times)[len(times) // 2]


# ---- one N ------------------------------------------------------------------------------------


def run_one(
    n_nodes: int,
    nproc: int,
    spares: int,
    hb_s: float,
    steps_per_s: float,
    steady_s: float,
    heartbeat_budget: float,
    heartbeat_timeout_s: float,
    failures: int = 1,
    inject_phase: float = 0.5,
    reports_beat: bool = True,
) -> dict[str, Any]:
    from resild.wire.keys import generate_keys

    mp_ctx = mp.get_context("spawn")
    spares = max(spares, failures)  # one spare per failure
    tmp = Path(tempfile.mkdtemp(prefix="resild-scale-"))
    active = [f"n{i:05d}" for i in range(n_nodes)]
    spare_names = [f"s{i:03d}" for i in range(spares)]
    allnodes = active + spare_names
    import inspect

    keys_dir = str(tmp / "keys")
    if "nodes" in inspect.signature(generate_keys).parameters:  # per-node keys where the transport has them
        generate_keys(tmp / "keys", allnodes)
    else:
        generate_keys(tmp / "keys")
    first_rank = {n: i * nproc for i, n in enumerate(active)}
    first_rank.update({n: 0 for n in spare_names})
    q = mp_ctx.Queue()
    stop, stop_w = mp_ctx.Pipe(duplex=False)
    ended = mp_ctx.Event()  # set by the controller; the driver only looks (never waits on it)
    cfg = {
        "active": active,
        "spares": spare_names,
        "nproc": nproc,
        "keys": keys_dir,
        "journal": str(tmp / "journal.jsonl"),
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "hang_timeout_s": 60.0,
        "heartbeat_budget": heartbeat_budget,
    }
    ctl = mp_ctx.Process(target=controller_main, args=(cfg, q, stop, ended), daemon=True)
    ctl.start()
    kind, endpoint = q.get(timeout=60)
    assert kind == "endpoint"
    n_gen = max(1, math.ceil(len(allnodes) / NODES_PER_GENERATOR))
    chunks = [allnodes[i::n_gen] for i in range(n_gen)]
    gens, conns = [], []
    failed: list[dict[str, Any]] = []
    for gid, chunk in enumerate(chunks):
        a, b = mp_ctx.Pipe()
        p = mp_ctx.Process(
            target=generator_main,
            daemon=True,
            args=(
                gid,
                chunk,
                nproc,
                {n: first_rank[n] for n in chunk},
                keys_dir,
                endpoint,
                hb_s,
                steps_per_s,
                reports_beat,
                b,
            ),
        )
        p.start()
        gens.append(p)
        conns.append(a)
    try:
        for c in conns:
            assert c.recv()[0] == "connected"
        time.sleep(1.0 + len(allnodes) / 500)  # CURVE handshakes (ZAP in Python) done before the clock starts
        import psutil

        proc = psutil.Process(ctl.pid)
        cpu_go = proc.cpu_times()
        t_go = time.monotonic()
        for c in conns:
            c.send(("go",))

        def await_epoch(epoch: int, want: list[str], timeout_s: float, watch: tuple[str, ...] = ()) -> dict[str, Any]:
            """Every generator's answer: when the last and the first wanted node held `epoch`,
            how many never did, the generators' CPU meanwhile, the watched nodes' times."""
            for c in conns:
                c.send(("await", epoch, want, timeout_s, list(watch)))
            out: dict[str, Any] = {"last": 0.0, "first": math.inf, "missing": 0, "gen_cpu_s": 0.0, "watched": {}}
            for c in conns:
                while True:
                    if ended.is_set() or not ctl.is_alive():  # it stopped the job (said on stderr)
                        raise RuntimeError(f"the controller stopped while epoch {epoch} was awaited")
                    if c.poll(0.5) and (msg := c.recv())[0] == "epoch":
                        break
                out["last"], out["first"] = max(out["last"], msg[3]), min(out["first"], msg[5])
                out["missing"] += msg[4]
                out["gen_cpu_s"] += msg[6]
                out["watched"].update(msg[7])
            return out

        e1 = await_epoch(1, active, 300.0)
        cpu_e1 = proc.cpu_times()
        if e1["missing"]:
            raise RuntimeError(f"{e1['missing']} nodes never got epoch 1")
        time.sleep(2.0)  # steady state
        for c in conns:
            c.send(("counts",))
        sent0 = sum(c.recv()[2]["sent"] for c in conns)
        main0 = next(t for t in proc.threads() if t.id == ctl.pid)
        c0, w0 = proc.cpu_times(), time.monotonic()
        time.sleep(steady_s)
        c1, w1 = proc.cpu_times(), time.monotonic()
        main1 = next(t for t in proc.threads() if t.id == ctl.pid)
        cpu_main_per_s = ((main1.user_time + main1.system_time) - (main0.user_time + main0.system_time)) / (w1 - w0)
        for c in conns:
            c.send(("counts",))
        sent1 = sum(c.recv()[2]["sent"] for c in conns)
        cpu_per_s = ((c1.user + c1.system) - (c0.user + c0.system)) / (w1 - w0)
        msgs_per_s = (sent1 - sent0) / (w1 - w0)
        members = list(active)
        for k in range(failures):
            if steps_per_s > 0:  # the same point of every step: at a step boundary all nodes report commits
                phase = ((time.monotonic() - t_go) * steps_per_s) % 1.0
                time.sleep(((inject_phase - phase) % 1.0) / steps_per_s)
            victim = members[(len(members) // 2 + 7 * k) % len(members)]
            gi = next(i for i, ch in enumerate(chunks) if victim in ch)
            cpu_f = _cpu_s(proc)
            conns[gi].send(("inject", victim))
            msg = conns[gi].recv()
            while msg[0] != "injected":
                msg = conns[gi].recv()
            members = [spare_names[k] if n == victim else n for n in members]
            got = await_epoch(k + 2, members, 60.0, watch=(spare_names[k],))
            cpu_a = _cpu_s(proc)
            got["t_fail"], got["spare"] = msg[2], spare_names[k]
            got["ctl_cpu_s"] = sum(cpu_a.values()) - sum(cpu_f.values())
            got["ctl_main_cpu_s"] = cpu_a["main"] - cpu_f["main"]
            got["ctl_zmq_cpu_s"] = cpu_a["zmq"] - cpu_f["zmq"]
            failed.append(got)
            time.sleep(0.5)  # the controller's event and the generators' next step settle
    finally:
        try:
            stop_w.send("stop")
        except (BrokenPipeError, OSError):
            pass  # it is gone already
        try:
            kind, recs, fsyncs = q.get(timeout=60)
        except Exception:
            recs, fsyncs = [], []
        for c in conns:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in gens:
            p.join(10)
            if p.is_alive():
                p.kill()
        ctl.join(10)
        if ctl.is_alive():
            ctl.kill()
    mem = {e["epoch"]: e for e in recs if e["event"] == "membership"}
    detected = [e["t_mono"] for e in recs if e["event"] == "failure_detected"]
    relay_s = relay_hop_s(n_nodes, nproc)
    rows = []
    for k, f in enumerate(failed):
        t_decide, m = detected[k], mem[k + 2]
        rows.append(
            {
                "decide_s": t_decide - f["t_fail"],
                "announce_s": f["last"] - t_decide + relay_s,
                "announce_nodes_s": f["last"] - t_decide,
                "announce_first_s": f["first"] - t_decide,
                "announce_spare_s": f["watched"].get(f["spare"], math.inf) - t_decide,
                "announce_ctl_s": m.get("announce_s"),
                "announce_cpu_s": m.get("announce_cpu_s"),
                "ctl_cpu_s": f["ctl_cpu_s"],
                "ctl_main_cpu_s": f["ctl_main_cpu_s"],
                "ctl_zmq_cpu_s": f["ctl_zmq_cpu_s"],
                "gen_cpu_s": f["gen_cpu_s"],
                "missing": f["missing"],
                "view": m.get("view"),
                "delta": m.get("delta"),
                "direct": m.get("direct"),
            }
        )

    def med(key: str, digits: int = 4) -> Any:
        vals = sorted(r[key] for r in rows if r[key] is not None)
        return round(vals[len(vals) // 2], digits) if vals else None

    out = {
        "nodes": n_nodes,
        "ranks": n_nodes * nproc,
        "register_s": round(mem[1]["t_mono"] - t_go, 3),
        "decide_s": med("decide_s"),
        "announce_s": med("announce_s"),
        "cpu_per_s": round(cpu_per_s, 3),
        "cpu_main_per_s": round(cpu_main_per_s, 3),  # the controller's Python thread (rest: zmq I/O + CURVE)
        # the decision's journal write + fsync (the first append is epoch 1's start record)
        "journal_s": round(sorted(fsyncs[1:])[len(fsyncs[1:]) // 2], 4) if len(fsyncs) > 1 else None,
        # the parts, and what the load was
        "epoch1_all_s": round(e1["last"] - t_go, 3),
        "announce_nodes_s": med("announce_nodes_s"),  # decision -> the slowest simulated node holds it
        "announce_first_s": med("announce_first_s"),  # decision -> the first one does
        "announce_spare_s": med("announce_spare_s"),  # decision -> the spare has its view (it has most to do)
        "relay_hop_s": round(relay_s, 4),
        "announce_ctl_s": med("announce_ctl_s", 6),  # the controller's sends (its main thread, wall)
        "announce_cpu_s": med("announce_cpu_s", 6),  # ... and their CPU
        # CPU while the failure was handled (inject -> every node holds the epoch): the controller
        # (all threads: decision, journal, sends, CURVE, and the steady traffic meanwhile) and
        # the load generators (receiving, decrypting, parsing 1,000 nodes' frames each).
        "announce_window_ctl_cpu_s": med("ctl_cpu_s"),
        "announce_window_ctl_main_cpu_s": med("ctl_main_cpu_s"),  # its Python thread
        "announce_window_ctl_zmq_cpu_s": med("ctl_zmq_cpu_s"),  # libzmq's I/O thread (CURVE, writes)
        "announce_window_gen_cpu_s": med("gen_cpu_s"),
        "announce_view": med("view", 0),
        "announce_delta": med("delta", 0),
        "announce_direct": med("direct", 0),
        # controller CPU (all threads) from the first registration to epoch 1 held by every node
        "register_cpu_s": round((cpu_e1.user + cpu_e1.system) - (cpu_go.user + cpu_go.system), 3),
        "missing": sum(r["missing"] for r in rows),
        "msgs_per_s": round(msgs_per_s),
        "generators": n_gen,
        "load1": round(os.getloadavg()[0], 1),  # this machine's load: latencies above are wall clock
        "heartbeat_s": round(max(hb_s, (n_nodes + spares) / heartbeat_budget if heartbeat_budget > 0 else 0), 3),
    }
    if failures > 1:
        out["announce_all_s"] = [round(r["announce_s"], 4) for r in rows]
        out["announce_spare_all_s"] = [round(r["announce_spare_s"], 4) for r in rows]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="250,1000,2000,4000", help="comma-separated node counts (active nodes)")
    p.add_argument("--nproc", type=int, default=8, help="ranks per node")
    p.add_argument("--spares", type=int, default=2)
    p.add_argument("--heartbeat-s", type=float, default=0.25, help="node heartbeat interval (resil-run's default)")
    p.add_argument("--steps-per-s", type=float, default=1.0)
    p.add_argument(
        "--heartbeat-budget",
        type=float,
        default=2000.0,
        help="controller's heartbeats/s budget (JobSettings.heartbeat_budget_per_s); 0: every node "
        "heartbeats at --heartbeat-s whatever N",
    )
    p.add_argument("--heartbeat-timeout", type=float, default=2.0, help="resil-run's default")
    p.add_argument("--steady-s", type=float, default=5.0, help="steady-state CPU measurement window")
    p.add_argument(
        "--failures", type=int, default=1, help="nodes failed one after the other (medians reported; a spare each)"
    )
    p.add_argument(
        "--inject-phase",
        type=float,
        default=0.5,
        help="where in a step the failure is injected (0: with the step's commit reports of every node)",
    )
    p.add_argument(
        "--no-report-heartbeats",
        action="store_true",
        help="simulated node processes heartbeat every interval even right after a commit report "
        "(the node process before issue 17; the baseline of the side-by-side run)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line")
    a = p.parse_args(argv)
    _raise_fd_limit()
    rows = []
    if not a.json:
        print(
            f"{'nodes':>6} {'ranks':>7} {'register_s':>10} {'decide_s':>9} {'announce_s':>10} "
            f"{'cpu_per_s':>9}   (announce: nodes + relay hop; ctl time; msgs/s in)",
            flush=True,
        )
    for n in [int(x) for x in a.nodes.split(",") if x]:
        r = run_one(
            n,
            a.nproc,
            a.spares,
            a.heartbeat_s,
            a.steps_per_s,
            a.steady_s,
            a.heartbeat_budget,
            a.heartbeat_timeout,
            a.failures,
            a.inject_phase,
            not a.no_report_heartbeats,
        )
        r["report_heartbeats"] = not a.no_report_heartbeats
        rows.append(r)
        if a.json:
            print(json.dumps(r), flush=True)
        else:
            print(
                f"{r['nodes']:>6} {r['ranks']:>7} {r['register_s']:>10.3f} {r['decide_s']:>9.4f} "
                f"{r['announce_s']:>10.4f} {r['cpu_per_s']:>9.3f}   ({r['announce_nodes_s']:.4f} + "
                f"{r['relay_hop_s']:.4f}; ctl {r['announce_ctl_s']:.4f}s; {r['msgs_per_s']}/s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
