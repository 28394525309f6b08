"""Group formation through the controller: one epoch's rendezvous traffic at N nodes x P ranks.

    python bench/rendezvous_scale.py                        # N = 250, 1000, 2000 x 8, a table
    python bench/rendezvous_scale.py --nodes 250 --json     # one JSON object per line, per N and side
    python bench/rendezvous_scale.py --nodes 0 --gloo-world-nodes 4,16   # the W^2 gloo world group
    python bench/rendezvous_scale.py --nodes 2000 --sides resild --lanes-per-node 8   # a requester per rank

resild side: the real controller (resild.controller.loop.Controller) in its own process,
ROUTER + CURVE with one key per node, every node registered (REGISTER_NODE and P
REGISTER_WORKER, epoch 1 announced) before anything is timed. No heartbeats, leases or
progress while the epochs run (timeouts set out of reach): the rendezvous cost alone.
Load generators hold one DEALER per simulated node (its own key) and send the STORE
requests of its P ranks as the worker's ControlLink does (one Channel per node, ids
unique per node); the controller answers through Handlers._on_store and Rendezvous.
TCPStore side: torch's TCPStore server in its own process, and a pool of clients opened
once (one thread each, in client processes), reused by every epoch.

Both sides run the same schedule. Per epoch, under resild/e<k>/: the NCCL world group (rank 0
sets a 128-byte unique id, every rank gets it: most gets wait for the set) and one group
per node (each rank sets its gloo key, 172 + 8 x P bytes, and reads the others). A lane is a
requester with one request in flight (a rank, or a TCPStore client serving several ranks);
lanes per node are the same on both sides, as many as --tcp-clients allows (8 at 250 nodes,
1 at 2,000). A lane serving several ranks does all their sets before any get (a blocking
client would otherwise wait on a key only it can set). --gloo-world-nodes runs the gloo
world group instead: each rank sets a 172 + 8 x W-byte key and reads every
other (W^2 values of O(W) bytes each: O(W^3) bytes, the same for any store). --gets: how a
gloo group reads its members' keys: multi (the default; what torch 2.13's gloo does over a
store with the extended API, as resild's is): one multi_get per 128 members, answered with
the values that fit one reply and asked again for the rest; single: a get per peer (before).

Per N and side (ABBA: resild, tcp, tcp, resild, ...; medians of --repeats each):
formation_s (first request sent -> last reply received), req_per_s (requests / formation_s),
server_cpu_s (the store server process, all its threads: for resild the controller's loop,
zmq I/O and CURVE; psutil), p50_ms / p99_ms (request sent -> its reply, as the requester
sees it: a get that waited for its key counts that wait), errors (answered with one) and
unanswered (never answered within --epoch-timeout: a STORE older than its 10-s TTL is
dropped by the controller). Also the load generators' CPU (they share this machine's
cores with the server) and the load average.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import multiprocessing as mp
import os
import resource
import socket
import statistics
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq

NODES_PER_GENERATOR = 1000
CLIENTS_PER_PROCESS = 1000  # TCPStore client threads per client process
UID_BYTES = 128  # ncclUniqueId


# One rank's key in a gloo group of n (torch 2.13's gloo, tcp/context.cc `Rank::bytes`): its
# hostname (20 characters here) and device address, then 8 bytes per peer (the pair ids).
def gloo_key(n: int) -> bytes:
    return b"a" * (8 + 20 + 8 + 136 + 8 * n)


FD_MARGIN = 256

Op = tuple[str, str, bytes]  # (op, key, value for a set)


class BenchError(Exception):
    """A usage or environment problem: one line on stderr, no traceback."""


def _raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def node_name(i: int) -> str:
    return f"n{i:05d}"


# ---- the schedule, the same on both sides ------------------------------------------------


def lanes_per_node(n_nodes: int, nproc: int, clients: int) -> int:
    """The most lanes per node (a divisor of nproc) with n_nodes x lanes <= clients."""
    return max([d for d in range(1, nproc + 1) if nproc % d == 0 and n_nodes * d <= clients], default=1)


def lane_ranks(node: int, lane: int, nproc: int, lpn: int) -> list[int]:
    return [node * nproc + lr for lr in range(lane, nproc, lpn)]


def lane_ops(epoch: int, pattern: str, ranks: list[int], nproc: int, world: int) -> list[Op]:
    p = f"resild/e{epoch}/"
    sets: list[Op] = []
    gets: list[Op] = []
    gloo_group = multi_get_ops if pattern.endswith(MULTI) else single_get_ops
    for r in ranks:
        if pattern.startswith("gloo_world"):
            sets.append(("set", f"{p}gloo_world/{r}", gloo_key(world)))
            gets += gloo_group(f"{p}gloo_world/", range(world), r)
            continue
        node, lr = divmod(r, nproc)
        if r == 0:
            sets.append(("set", f"{p}nccl_world/uid", b"u" * UID_BYTES))
        sets.append(("set", f"{p}node{node}/{lr}", gloo_key(nproc)))
        gets.append(("get", f"{p}nccl_world/uid", b""))
        gets += gloo_group(f"{p}node{node}/", range(nproc), lr)
    return sets + gets


MULTI = "+mget"  # pattern suffix: gloo groups read as torch 2.13's gloo does with a store that has
BATCH = 128  # the extended API (GLOO_ENABLE_STORE_V2_API, LinkStore): one multi_get per 128 ranks


def single_get_ops(prefix: str, members: range, me: int) -> list[Op]:
    """A get per peer (the fewest a plain store allows; gloo itself adds a wait per rank)."""
    return [("get", f"{prefix}{q}", b"") for q in members if q != me]


def multi_get_ops(prefix: str, members: range, me: int) -> list[Op]:
    """Every member's key (its own included, as gloo asks) in multi_gets of BATCH keys; the
    keys of one op travel joined by newlines in the key field."""
    keys = [f"{prefix}{q}" for q in members]
    return [("multi_get", "\n".join(keys[i : i + BATCH]), b"") for i in range(0, len(keys), BATCH)]


def epoch_result(parts: list[tuple[float, float, bytes, int, int, int]]) -> dict[str, Any]:
    """Merge the requesters' (first sent, last answered, latencies, requests, errors)."""
    lat = array("d")
    for part in parts:
        lat.frombytes(part[2])
    lat_s = sorted(lat)
    first = min(p[0] for p in parts)
    last = max(p[1] for p in parts)
    n = sum(p[3] for p in parts)

    def pct(q: float) -> float:
        return lat_s[min(len(lat_s) - 1, int(q * len(lat_s)))] * 1e3 if lat_s else math.nan

    return {
        "formation_s": last - first,
        "requests": n,
        "answered": len(lat_s),
        "errors": sum(p[4] for p in parts),  # answered with an error
        "unanswered": n - len(lat_s),  # never answered (dropped, or after its lane's error)
        "server_requests": sum(p[5] for p in parts),  # what reached the store server
        "p50_ms": pct(0.50),
        "p99_ms": pct(0.99),
    }


# ---- resild: the controller process ---------------------------------------------------------


def controller_main(cfg: dict[str, Any], out: Any, stop: Any) -> None:
    _raise_fd_limit()
    from resild.controller.backend import Backend
    from resild.controller.journal import Journal
    from resild.controller.loop import Controller, ControllerConfig, JobResult
    from resild.events.log import EventLog
    from resild.wire.keys import KeyDir
    from resild.wire.settings import JobSettings

    never = 3600.0  # no node is lost, no lease sent while the bench runs: rendezvous only
    ccfg = ControllerConfig(
        bind="tcp://127.0.0.1:0",
        settings=JobSettings(
            heartbeat_timeout_s=never,
            start_heartbeat_timeout_s=never,
            hang_timeout_s=never,
            start_timeout_s=never,
            controller_timeout_s=0.0,
        ),
    )
    nodes = [node_name(i) for i in range(cfg["nodes"])]
    ctl = Controller(ccfg, nodes, [], cfg["nproc"], KeyDir(Path(cfg["keys"])), EventLog(None), Journal(None), Backend())
    out.put(("endpoint", ctl.endpoint))

    def stopper() -> None:
        stop.wait()
        ctl.result = JobResult(0, "bench over")

    threading.Thread(target=stopper, daemon=True).start()
    if os.environ.get("RESILD_BENCH_PROFILE"):  # where the controller's time goes (as controller_scale.py)
        import cProfile

        prof = cProfile.Profile(time.thread_time)  # CPU of this thread: wall time would count preemption
        prof.runcall(ctl.run)
        prof.dump_stats(os.environ["RESILD_BENCH_PROFILE"])
    else:
        ctl.run()


# ---- resild: a load generator process -------------------------------------------------------


def resild_gen_main(
    nodes: list[int], nproc: int, lpn: int, world: int, keys_dir: str, endpoint: str, through_node: bool, conn: Any
) -> None:
    _raise_fd_limit()
    from launcher.node.node_store import NodeStore
    from resild.wire.channel import Channel, connect
    from resild.wire.keys import KeyDir
    from resild.wire.protocol import MsgType

    ctx = zmq.Context(io_threads=1)
    ctx.MAX_SOCKETS = 2 * len(nodes) + 64
    keys = KeyDir(Path(keys_dir))
    chans: list[Channel] = []
    for n in nodes:
        chans.append(connect(ctx, endpoint, keys.node(node_name(n)), sender=f"{node_name(n)}/node", watch=False))
    by_sock = {ch.sock: i for i, ch in enumerate(chans)}
    poller = zmq.Poller()
    for ch in chans:
        poller.register(ch.sock, zmq.POLLIN)
    pid = os.getpid()
    rid = 0  # request ids: unique per node (unique in this process)

    def frames(timeout_ms: int) -> list[tuple[int, dict[str, Any], float]]:
        got = []
        for sock, _ in poller.poll(timeout_ms):
            t = time.monotonic()
            for _ in range(64):
                try:
                    raw = json.loads(sock.recv(flags=zmq.NOBLOCK))
                except zmq.Again:
                    break
                got.append((by_sock[sock], raw, t))
        return got

    def register(timeout_s: float) -> int:
        """REGISTER_NODE + P REGISTER_WORKER per node; -> nodes that got epoch 1."""
        for i, ch in enumerate(chans):
            name = node_name(nodes[i])
            # "relayed": the node process relays the epoch to its workers (the controller sends
            # one view per node, not the whole layout to every rank)
            ch.send(
                MsgType.REGISTER_NODE,
                {"node": name, "pid": pid, "nproc": nproc, "epoch": 0, "relayed": list(range(nproc))},
            )
            for lr in range(nproc):
                ch.send(MsgType.REGISTER_WORKER, {"node": name, "local_rank": lr, "pid": pid})
        held: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(held) < len(chans) and time.monotonic() < deadline:
            for i, raw, _ in frames(100):
                if raw.get("type") == "membership":
                    held.add(i)
        return len(held)

    def run_epoch(epoch: int, pattern: str, timeout_s: float) -> tuple[float, float, bytes, int, int, int]:
        nonlocal rid
        lanes = [
            (i, lane_ops(epoch, pattern, lane_ranks(n, k, nproc, lpn), nproc, world))
            for i, n in enumerate(nodes)
            for k in range(lpn)
        ]
        b64 = {v: base64.b64encode(v).decode() for _, ops in lanes for _, _, v in ops if v}
        pos = [0] * len(lanes)
        inflight: dict[int, tuple[int, float]] = {}  # request id -> (lane, sent at)
        lat = array("d")
        errors = forwarded = 0
        t_last = 0.0  # the last reply's arrival (from t_first on, below)
        # --sides resild-node: each simulated node process's NodeStore (launcher/node/node_store.py,
        # the real class) between its lanes and the controller; its ipc hop is not simulated.
        stores = [NodeStore() for _ in nodes] if through_node else []
        answered: list[tuple[dict[str, Any], float]] = []  # replies to process (a reply may send)

        def send(li: int) -> None:
            nonlocal rid, forwarded
            i, ops = lanes[li]
            op, key, value = ops[pos[li]]
            rid += 1
            body: dict[str, Any] = {
                "node": node_name(nodes[i]),
                "id": rid,
                "op": op,
                "keys": key.split("\n") if op == "multi_get" else [key],
                "timeout_s": timeout_s,
            }
            if op == "set":
                body["value"] = b64[value]
            inflight[rid] = (li, time.monotonic())
            if not through_node:
                chans[i].send(MsgType.STORE, body)  # the worker's TTL (10 s): a backlog past it drops requests
                return
            scope = "node" if key.startswith(f"resild/e{epoch}/node") else "job"
            replies, fwd = stores[i].request(b"", {**body, "scope": scope}, time.monotonic())
            now = time.monotonic()
            answered.extend((b, now) for _, b in replies)
            if fwd is not None:
                forwarded += 1
                chans[i].send(MsgType.STORE, {**fwd, "node": node_name(nodes[i])}, ttl_s=timeout_s + 1.0)

        def complete(b: dict[str, Any], t: float) -> None:
            nonlocal errors, t_last
            slot = inflight.pop(int(b.get("id", -1)), None)
            if slot is None:
                return
            li, t_sent = slot
            lat.append(t - t_sent)
            t_last = t
            op, key, _ = lanes[li][1][pos[li]]
            if b.get("ok") and op == "multi_get" and len(b["values"]) < key.count("\n") + 1:
                rest = key.split("\n")[len(b["values"]) :]  # the rest did not fit one reply: asked again (LinkStore)
                lanes[li][1].insert(pos[li] + 1, (op, "\n".join(rest), b""))
            if not b.get("ok"):
                errors += 1  # this lane stops: its next requests count as unanswered
                return
            pos[li] += 1
            if pos[li] < len(lanes[li][1]):
                send(li)

        def drain() -> None:
            while answered:
                complete(*answered.pop())

        t_first = time.monotonic()
        t_last = t_first
        for li in range(len(lanes)):
            send(li)
            drain()
        deadline = t_first + timeout_s
        while inflight and time.monotonic() < deadline:
            for i, raw, t in frames(50):
                if raw.get("type") != "store_reply":
                    if raw.get("type") == "error":
                        errors += 1
                    continue
                if through_node:
                    answered.extend((b, t) for _, b in stores[i].reply(raw["body"]))
                else:
                    answered.append((raw["body"], t))
                drain()
        n_req = sum(len(ops) for _, ops in lanes)  # after splits: every request sent
        n_fwd = forwarded if through_node else n_req
        return t_first, t_last, lat.tobytes(), n_req, errors, n_fwd

    conn.send(("connected",))
    while True:
        cmd = conn.recv()
        if cmd[0] == "register":
            conn.send(("registered", register(cmd[1])))
        elif cmd[0] == "epoch":
            conn.send(("done", run_epoch(cmd[1], cmd[2], cmd[3])))
        elif cmd[0] == "stop":
            for ch in chans:
                ch.close()
            ctx.term()
            return
        frames(0)  # what came meanwhile (announcements): read and dropped


# ---- TCPStore: the server and client processes ----------------------------------------------


def tcp_server_main(conn: Any) -> None:
    _raise_fd_limit()
    from datetime import timedelta

    import torch.distributed as dist

    # Bound to IPv4 here: torch's own listener is dual-stack, and the peer name it then looks up
    # (::ffff:127.0.0.1) goes to DNS, which in a sandbox can stall an accept for seconds.
    ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    ls.bind(("127.0.0.1", 0))
    ls.listen(4096)
    port = ls.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=600),
        master_listen_fd=ls.fileno(),
    )
    conn.send(("port", port, bool(getattr(store, "libuvBackend", False))))
    conn.recv()  # stop


def tcp_client_main(port: int, lanes: list[list[int]], nproc: int, world: int, timeout_s: float, conn: Any) -> None:
    _raise_fd_limit()
    from datetime import timedelta

    import torch.distributed as dist

    n = len(lanes)
    stores: list[Any] = [None] * n
    results: list[Any] = [None] * n
    job: list[Any] = [None]  # (epoch, pattern) or None: stop
    start, end = threading.Barrier(n + 1), threading.Barrier(n + 1)
    open_errors: list[str] = []

    def lane(i: int) -> None:
        try:
            stores[i] = dist.TCPStore(
                "127.0.0.1", port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
        except Exception as e:  # reported by the main thread
            open_errors.append(repr(e))
        end.wait()
        while True:
            start.wait()
            if job[0] is None:
                return
            ops = lane_ops(job[0][0], job[0][1], lanes[i], nproc, world)
            lat = array("d")
            errors = 0
            t_first = t_last = time.monotonic()
            for op, key, value in ops if stores[i] is not None else []:
                t = time.monotonic()
                try:
                    if op == "set":
                        stores[i].set(key, value)
                    elif op == "multi_get":
                        stores[i].multi_get(key.split("\n"))
                    else:
                        stores[i].get(key)
                except Exception:  # answered with an error (a timeout): this lane stops, as resild's does
                    lat.append(time.monotonic() - t)
                    errors += 1
                    break
                t_last = time.monotonic()
                lat.append(t_last - t)
            results[i] = (t_first, t_last, lat.tobytes(), len(ops), errors, len(ops))
            end.wait()

    conn.send(("ready",))
    assert conn.recv()[0] == "open"
    threads = [threading.Thread(target=lane, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    end.wait()
    conn.send(("opened", time.monotonic(), open_errors[:3], len(open_errors)))
    while True:
        cmd = conn.recv()
        job[0] = (cmd[1], cmd[2]) if cmd[0] == "epoch" else None
        start.wait()
        if job[0] is None:
            return
        end.wait()
        lat = array("d")
        for r in results:
            lat.frombytes(r[2])
        conn.send(
            (
                "done",
                (
                    min(r[0] for r in results),
                    max(r[1] for r in results),
                    lat.tobytes(),
                    sum(r[3] for r in results),
                    sum(r[4] for r in results),
                    sum(r[5] for r in results),
                ),
            )
        )


# ---- one N: both sides set up once, epochs ABBA ---------------------------------------------


def _recv(conn: Any, what: str, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise BenchError(f"no {what} from a bench process within {timeout_s:.0f}s")
    try:
        return conn.recv()
    except EOFError:
        raise BenchError(f"a bench process died before its {what} (see its stderr above)") from None


def _main_cpu(proc: Any) -> float:
    """The process's first thread (the controller's Python loop; the rest is zmq I/O, CURVE, ZAP)."""
    t = next((t for t in proc.threads() if t.id == proc.pid), None)
    return t.user_time + t.system_time if t is not None else math.nan


def _cpu(procs: list[Any]) -> float:
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def check_fds(n_nodes: int, clients: int) -> None:
    hard = _raise_fd_limit()
    # The busiest process: the controller (a TCP connection per node), a generator (a zmq
    # socket + connection per node), the TCPStore server (one per client).
    need = max(n_nodes, 2 * min(n_nodes, NODES_PER_GENERATOR), clients, min(clients, CLIENTS_PER_PROCESS)) + FD_MARGIN
    if hard < need:
        raise BenchError(
            f"{n_nodes} nodes / {clients} TCPStore clients need about {need} open files in one process, the hard "
            f"limit (ulimit -Hn) is {hard}: raise it, or lower --nodes / --tcp-clients"
        )


class Side:
    """One side's processes: the server (measured) and its load generators (pipes)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.server: Any = None  # psutil.Process
        self.gens: list[Any] = []  # psutil.Process
        self.info: dict[str, Any] = {}

    def spawn(self, mp_ctx: Any, target: Callable[..., None], args: tuple[Any, ...], conn: bool = True) -> Any:
        c1, c2 = mp_ctx.Pipe()
        p = mp_ctx.Process(target=target, args=(*args, c2), daemon=True)
        p.start()
        self.procs.append(p)
        if conn:
            self.conns.append(c1)
        return p, c1

    def close(self, extra: list[Any]) -> None:
        for c in self.conns + extra:
            try:
                c.send(("stop",))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()


def start_resild(
    side: Side,
    mp_ctx: Any,
    n_nodes: int,
    nproc: int,
    lpn: int,
    tmp: Path,
    stop: Any,
    log: Callable[[str], None],
    through_node: bool = False,
) -> None:
    import psutil

    from resild.wire.keys import generate_keys

    t = time.monotonic()
    keys = str(tmp / "keys")
    generate_keys(tmp / "keys", [node_name(i) for i in range(n_nodes)])
    log(f"{n_nodes} nodes: keys in {time.monotonic() - t:.1f}s")
    q = mp_ctx.Queue()
    ctl = mp_ctx.Process(
        target=controller_main, args=({"nodes": n_nodes, "nproc": nproc, "keys": keys}, q, stop), daemon=True
    )
    ctl.start()
    side.procs.append(ctl)
    try:
        _, endpoint = q.get(timeout=120)
    except Exception:
        raise BenchError("the controller process did not start (see its stderr above)") from None
    side.server = psutil.Process(ctl.pid)
    n_gen = max(1, math.ceil(n_nodes / NODES_PER_GENERATOR))
    for g in range(n_gen):
        p, _ = side.spawn(
            mp_ctx,
            resild_gen_main,
            (list(range(g, n_nodes, n_gen)), nproc, lpn, n_nodes * nproc, keys, endpoint, through_node),
        )
        side.gens.append(psutil.Process(p.pid))
    for c in side.conns:
        _recv(c, "connection", 300)
    time.sleep(1.0 + n_nodes / 500)  # CURVE handshakes (ZAP in Python) done before registering
    t = time.monotonic()
    for c in side.conns:
        c.send(("register", 300.0))
    held = sum(_recv(c, "registration", 330)[1] for c in side.conns)
    if held < n_nodes:
        raise BenchError(f"only {held} of {n_nodes} simulated nodes got epoch 1 from the controller")
    log(f"{n_nodes} nodes registered, epoch 1 held by all in {time.monotonic() - t:.1f}s")


def start_tcpstore(
    side: Side, mp_ctx: Any, n_nodes: int, nproc: int, lpn: int, timeout_s: float, log: Callable[[str], None]
) -> Any:
    """-> the server's pipe (told to stop last). The client pool is opened once, here."""
    import psutil

    srv, srv_conn = side.spawn(mp_ctx, tcp_server_main, (), conn=False)
    side.server = psutil.Process(srv.pid)
    _, port, libuv = _recv(srv_conn, "TCPStore port", 120)
    lanes = [lane_ranks(n, k, nproc, lpn) for n in range(n_nodes) for k in range(lpn)]
    n_cp = max(1, math.ceil(len(lanes) / CLIENTS_PER_PROCESS))
    for i in range(n_cp):
        p, _ = side.spawn(mp_ctx, tcp_client_main, (port, lanes[i::n_cp], nproc, n_nodes * nproc, timeout_s))
        side.gens.append(psutil.Process(p.pid))
    for c in side.conns:
        _recv(c, "start-up", 120)
    t = time.monotonic()
    for c in side.conns:
        c.send(("open",))
    opened = [_recv(c, "client pool", 900) for c in side.conns]
    side.info["tcp_open_s"] = round(max(o[1] for o in opened) - t, 1)
    side.info["tcp_clients"] = len(lanes)
    if sum(o[3] for o in opened):
        raise BenchError(f"{sum(o[3] for o in opened)} TCPStore clients failed to open: {opened[0][2]}")
    log(
        f"{len(lanes)} TCPStore clients opened in {side.info['tcp_open_s']}s ({'libuv' if libuv else 'classic'} server)"
    )
    return srv_conn


def run_n(n_nodes: int, pattern: str, a: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    nproc = a.nproc
    world = n_nodes * nproc
    lpn = a.lanes_per_node or lanes_per_node(n_nodes, nproc, a.tcp_clients)
    check_fds(n_nodes, n_nodes * lpn if "tcpstore" in a.sides else 0)
    mp_ctx = mp.get_context("spawn")
    stop = mp_ctx.Event()
    sides = {name: Side(name) for name in a.sides}
    srv_conns: list[Any] = []
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in a.sides}
    try:
        for name in ("resild", "resild-node"):
            if name in sides:
                tmp = Path(tempfile.mkdtemp(prefix="resild-rdv-"))
                start_resild(sides[name], mp_ctx, n_nodes, nproc, lpn, tmp, stop, log, name == "resild-node")
        if "tcpstore" in sides:
            srv_conns.append(start_tcpstore(sides["tcpstore"], mp_ctx, n_nodes, nproc, lpn, a.epoch_timeout, log))
        order = [*a.sides, *reversed(a.sides)]  # ABBA
        for i in range(len(a.sides) * a.repeats):
            side = sides[order[i % len(order)]]
            epoch = i + 2  # epoch 1 is the one announced at registration
            time.sleep(0.5)  # the previous side's stragglers settle
            c0, m0, g0 = _cpu([side.server]), _main_cpu(side.server), _cpu(side.gens)
            for c in side.conns:
                c.send(("epoch", epoch, pattern, a.epoch_timeout))
            parts = [_recv(c, "epoch result", a.epoch_timeout + 60)[1] for c in side.conns]
            r = epoch_result(parts)
            r["server_cpu_s"] = _cpu([side.server]) - c0
            r["server_main_cpu_s"] = _main_cpu(side.server) - m0
            r["gen_cpu_s"] = _cpu(side.gens) - g0
            runs[side.name].append(r)
            log(
                f"  {side.name:>11} e{epoch}: {r['formation_s']:.3f}s, {r['requests']} requests "
                f"({r['server_requests']} to the server), "
                f"server cpu {r['server_cpu_s']:.2f}s, errors {r['errors']}, unanswered {r['unanswered']}"
            )
    finally:
        stop.set()
        for side in sides.values():
            side.close(srv_conns if side.name == "tcpstore" else [])
    load1 = os.getloadavg()[0]
    rows = []
    keys = ("formation_s", "server_cpu_s", "server_main_cpu_s", "gen_cpu_s", "p50_ms", "p99_ms")
    for name, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in keys}
        reqs = rs[0]["requests"]
        rows.append(
            {
                "side": name,
                "pattern": pattern,
                "nodes": n_nodes,
                "ranks": world,
                "requests": reqs,
                "server_requests": rs[0]["server_requests"],
                "formation_s": round(med["formation_s"], 3),
                "req_per_s": round(reqs / med["formation_s"]) if med["formation_s"] > 0 else None,
                "server_cpu_s": round(med["server_cpu_s"], 3),
                "req_per_cpu_s": round(reqs / med["server_cpu_s"]) if med["server_cpu_s"] > 0 else None,
                # resild: the controller's Python loop thread (the rest: zmq I/O and CURVE)
                "server_main_cpu_s": round(med["server_main_cpu_s"], 3) if name != "tcpstore" else None,
                "p50_ms": round(med["p50_ms"], 2),
                "p99_ms": round(med["p99_ms"], 2),
                "errors": sum(r["errors"] for r in rs),
                "unanswered": sum(r["unanswered"] for r in rs),  # all epochs together
                "formation_all_s": [round(r["formation_s"], 3) for r in rs],
                "gen_cpu_s": round(med["gen_cpu_s"], 2),  # the load generators' CPU (same cores)
                "lanes_per_node": lpn,
                **sides[name].info,
                "load1": round(load1, 1),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", default="250,1000,2000", help="comma-separated node counts (NCCL world + node groups)")
    p.add_argument("--gloo-world-nodes", default="", help="comma-separated node counts for the gloo world group")
    p.add_argument("--nproc", type=int, default=8, help="ranks per node")
    p.add_argument("--repeats", type=int, default=3, help="epochs per side (ABBA order)")
    p.add_argument(
        "--tcp-clients",
        type=int,
        default=2000,
        help="TCPStore client pool (one thread each); lanes per node on both sides follow from it",
    )
    p.add_argument(
        "--lanes-per-node",
        type=int,
        default=0,
        help="requesters per node, both sides (a divisor of --nproc; 0: as many as --tcp-clients allows)",
    )
    p.add_argument(
        "--sides",
        default="resild-node,resild,tcpstore",
        help="any of resild-node (through each node process's store, as a job with a relay runs), resild "
        "(every request to the controller) and tcpstore, in ABBA order",
    )
    p.add_argument(
        "--epoch-timeout", type=float, default=120.0, help="seconds an epoch may take before it counts errors"
    )
    p.add_argument(
        "--gets",
        default="multi",
        choices=("multi", "single", "both"),
        help="how a gloo group reads its peers' keys: multi (one multi_get per 128 ranks, as gloo does over "
        "resild's store now), single (a get per peer, as before), both (each case twice)",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per line (per N and side)")
    a = p.parse_args(argv)
    suffixes = {"multi": [MULTI], "single": [""], "both": ["", MULTI]}[a.gets]
    try:
        plan = [(int(x), "nccl+node" + m) for x in a.nodes.split(",") if x.strip() and int(x) > 0 for m in suffixes]
        plan += [
            (int(x), "gloo_world" + m)
            for x in a.gloo_world_nodes.split(",")
            if x.strip() and int(x) > 0
            for m in suffixes
        ]
    except ValueError:
        p.error("--nodes and --gloo-world-nodes take comma-separated whole numbers")
    if a.nproc < 1 or a.repeats < 1 or a.tcp_clients < 1:
        p.error("--nproc, --repeats and --tcp-clients must be >= 1")
    a.sides = [x.strip() for x in a.sides.split(",") if x.strip()]
    known = ("resild-node", "resild", "tcpstore")
    if not a.sides or any(x not in known for x in a.sides) or len(set(a.sides)) != len(a.sides):
        p.error(f"--sides takes a comma-separated subset of {', '.join(known)}")
    if a.lanes_per_node and (a.lanes_per_node < 0 or a.nproc % a.lanes_per_node):
        p.error("--lanes-per-node must divide --nproc")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's per-connection warnings, in every child

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        for n, _ in plan:
            lpn = a.lanes_per_node or lanes_per_node(n, a.nproc, a.tcp_clients)
            check_fds(n, n * lpn if "tcpstore" in a.sides else 0)
        if not a.json:
            print(
                f"{'pattern':>15} {'nodes':>5} {'ranks':>6} {'side':>11} {'requests':>8} {'to_srv':>7} {'formation_s':>11} "
                f"{'req/s':>6} {'srv_cpu_s':>9} {'req/cpu_s':>9} {'p50_ms':>7} {'p99_ms':>8}  "
                "(lanes/node, generators' cpu_s, load1)",
                flush=True,
            )
        for n, pattern in plan:
            for r in run_n(n, pattern, a, log):
                if a.json:
                    print(json.dumps(r), flush=True)
                    continue
                print(
                    f"{r['pattern']:>15} {r['nodes']:>5} {r['ranks']:>6} {r['side']:>11} {r['requests']:>8} "
                    f"{r['server_requests']:>7} "
                    f"{r['formation_s']:>11.3f} {r['req_per_s']!s:>6} {r['server_cpu_s']:>9.2f} "
                    f"{r['req_per_cpu_s']!s:>9} {r['p50_ms']:>7.1f} {r['p99_ms']:>8.1f}  "
                    f"({r['lanes_per_node']}, {r['gen_cpu_s']:.1f}, {r['load1']})"
                    f"{'  ERRORS ' + str(r['errors']) if r['errors'] else ''}"
                    f"{'  UNANSWERED ' + str(r['unanswered']) if r['unanswered'] else ''}",
                    flush=True,
                )
    except BenchError as e:
        print(f"rendezvous_scale: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
