"""Adversarial tests of the node daemon's listeners and its prober (audit findings).

Each test is an attack that once worked: idle TCP connections exhausting the daemon's
threads (the prober then died and the node stayed HEALTHY), a stuck prober that the
systemd watchdog never noticed, and a few uids dribbling bytes into the status socket
until root was locked out."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq

import resild.daemon.agent as daemon_agent
from resild.daemon.agent import Agent
from resild.daemon.metrics import Metrics
from resild.health.config import Config
from resild.health.model import Verdict
from resild.health.probes import ProbeResult
from resild.wire.local_socket import local_request
from resild.wire.protocol import MsgType

pytestmark = pytest.mark.timeout(60)


class Switch:
    """A probe whose verdict the test sets (a GPU that later reports Xid 79)."""

    name = "switch"

    def __init__(self) -> None:
        self.verdict = Verdict.HEALTHY

    def check(self) -> ProbeResult:
        ok = self.verdict is Verdict.HEALTHY
        return ProbeResult(self.verdict, [] if ok else ["GPU 0 Xid 79 GPU has fallen off the bus"])


@contextlib.contextmanager
def running_agent(public_dir: Path, probe: Any, **cfg_kw: Any) -> Iterator[Agent]:
    cfg = Config(
        node="n1",
        state_dir=str(public_dir),
        status_socket=str(public_dir / "s.sock"),
        status_group="",
        **{"probe_interval_s": 0.1, "probe_timeout_s": 0.5, **cfg_kw},
    )
    ctx = zmq.Context()
    a = Agent(cfg, probes=[probe], ctx=ctx)
    a.start()
    t = threading.Thread(target=a.run, daemon=True)
    t.start()
    try:
        yield a
    finally:
        a.close()
        t.join(3)
        ctx.term()


def _status(a: Agent) -> dict[str, Any]:
    rep = local_request(a.cfg.status_endpoint, MsgType.STATUS, timeout_s=2.0)
    assert rep is not None and rep.type is MsgType.STATUS_REPLY
    return rep.body


def _wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


# -- the daemon fails closed -------------------------------------------------------------


def test_a_probe_that_cannot_start_its_thread_fails_the_node_and_the_prober_lives_on(
    public_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the task limit Thread.start() raised inside the prober: the prober died, and a
    later Xid 79 left `resild status` HEALTHY while the socket kept answering."""
    probe = Switch()
    with running_agent(public_dir, probe) as a:
        assert _wait_for(lambda: _status(a)["verdict"] == "healthy")
        real_start = threading.Thread.start

        def no_thread(self: threading.Thread) -> None:
            if self.name.startswith("probe:"):
                raise RuntimeError("can't start new thread")
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", no_thread)
        assert _wait_for(lambda: _status(a)["verdict"] == "failed"), _status(a)
        assert any("can't start new thread" in r for r in _status(a)["reasons"]), _status(a)["reasons"]
        monkeypatch.setattr(threading.Thread, "start", real_start)
        assert _wait_for(lambda: _status(a)["verdict"] == "healthy"), "the prober did not come back"
        probe.verdict = Verdict.FAILED  # the Xid 79 that used to go unseen
        assert _wait_for(lambda: _status(a)["verdict"] == "failed")
        assert any("Xid 79" in r for r in _status(a)["reasons"])


def test_an_exception_in_the_prober_loop_is_a_failed_verdict_not_a_dead_prober(
    public_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = Switch()
    with running_agent(public_dir, probe) as a:
        assert _wait_for(lambda: _status(a)["verdict"] == "healthy")
        broken = {"on": True}
        real = a.metrics.on_outcomes

        def exploding(outcomes: Any) -> None:
            if broken["on"]:
                raise MemoryError("metrics exploded")
            real(outcomes)

        monkeypatch.setattr(a.metrics, "on_outcomes", exploding)
        assert _wait_for(lambda: _status(a)["verdict"] == "failed")
        assert any("metrics exploded" in r for r in _status(a)["reasons"]), _status(a)["reasons"]
        broken["on"] = False
        assert _wait_for(lambda: _status(a)["verdict"] == "healthy"), "the prober did not come back"


def test_the_watchdog_starves_and_the_verdict_fails_when_the_prober_is_stuck(
    public_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The main loop fed the watchdog whatever the prober did: a stuck prober was never
    restarted. Now the watchdog is fed only while the prober makes rounds."""
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(public_dir / "notify.sock"))
    notify.settimeout(0.05)
    monkeypatch.setenv("NOTIFY_SOCKET", str(public_dir / "notify.sock"))
    monkeypatch.setenv("WATCHDOG_USEC", "100000")  # fed every 50 ms
    monkeypatch.delenv("WATCHDOG_PID", raising=False)

    def pings(for_s: float) -> int:
        notify.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # what was queued before now does not count
                notify.recv(4096)
        notify.settimeout(0.05)
        n, end = 0, time.monotonic() + for_s
        while time.monotonic() < end:
            with contextlib.suppress(TimeoutError):
                n += notify.recv(4096).count(b"WATCHDOG=1")
        return n

    release = threading.Event()
    try:
        with running_agent(public_dir, Switch(), probe_interval_s=0.1, probe_timeout_s=0.2) as a:
            assert pings(0.5) > 0
            monkeypatch.setattr(a, "_check_once", lambda: release.wait(30))  # wedged outside any probe deadline
            stuck_after = 0.1 + 0.2 + daemon_agent.PROBER_SLACK_S  # interval + one probe's timeout + slack
            assert _wait_for(lambda: _status(a)["verdict"] == "failed", stuck_after + 3.0)
            assert any("prober" in r for r in _status(a)["reasons"]), _status(a)
            assert pings(0.5) == 0, "the watchdog is still fed while the prober is stuck"
            release.set()
    finally:
        release.set()
        notify.close()


# -- the metrics endpoint is bounded -----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_idle_connections_to_the_metrics_port_do_not_grow_threads() -> None:
    """3,000 idle connections made 2,881 threads (one per connection, no timeout)."""
    m = Metrics("n1")
    port = _free_port()
    base = threading.active_count()
    m.serve(port)
    flood: list[socket.socket] = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", port), timeout=2)
            flood.append(s)
        time.sleep(0.5)
        grown = threading.active_count() - base
        assert grown <= 40, f"{grown} threads for 300 idle connections"
    finally:
        for s in flood:
            s.close()
    # Once the flood is gone, scraping works again.
    ok = _wait_for(lambda: _scrape(port) is not None, 5.0)
    close = getattr(m, "close", None)
    if close is not None:
        close()
    assert ok


def test_a_dribbling_metrics_connection_is_closed_at_its_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    """One byte per socket timeout kept a connection (and its slot) forever: each
    connection now has a deadline of its own, whatever it sends."""
    import resild.daemon.metrics as metrics_mod

    monkeypatch.setattr(metrics_mod, "MAX_CONNECTION_S", 1.0, raising=False)
    m = Metrics("n1")
    port = _free_port()
    m.serve(port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2) as s:
            t0 = time.monotonic()
            closed_after = None
            for ch in b"GET /metrics HTTP/1.1 and so on, very slowly":
                try:
                    s.sendall(bytes([ch]))
                    if s.recv(100) == b"":
                        closed_after = time.monotonic() - t0
                        break
                except TimeoutError:
                    continue
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
            assert closed_after is not None and closed_after < 3.0, closed_after
    finally:
        close = getattr(m, "close", None)
        if close is not None:
            close()


def _scrape(port: int) -> bytes | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1) as r:
            body: bytes = r.read()
            return body if b"resild_" in body else None
    except OSError:
        return None


def test_an_idle_metrics_connection_is_closed_after_the_socket_timeout() -> None:
    m = Metrics("n1")
    port = _free_port()
    m.serve(port)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=8) as s:
            t0 = time.monotonic()
            s.sendall(b"GET /metr")  # a partial request line, then nothing
            with contextlib.suppress(ConnectionResetError):
                s.recv(100)  # TimeoutError (a failure) when the server never lets go
            took = time.monotonic() - t0
        assert took < 7, f"an idle connection was held {took:.1f}s"
    finally:
        close = getattr(m, "close", None)
        if close is not None:
            close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the point of the test
def test_a_dead_prober_fails_the_verdict(public_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What no `except Exception` catches (SystemExit in a round) ends the prober thread:
    the main loop says so in the verdict (and stops feeding the watchdog)."""

    def exits() -> None:
        raise SystemExit("gone")

    with running_agent(public_dir, Switch()) as a:
        assert _wait_for(lambda: _status(a)["verdict"] == "healthy")
        monkeypatch.setattr(a, "_check_once", exits)
        assert _wait_for(lambda: _status(a)["verdict"] == "failed")
        assert any("prober thread is dead" in r for r in _status(a)["reasons"]), _status(a)["reasons"]
        assert a.prober_problem(time.monotonic()) is not None


def test_the_metrics_port_knows_a_local_clients_uid() -> None:
    from resild.daemon.metrics import local_uid

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        with socket.create_connection(srv.getsockname(), timeout=2) as c:
            assert local_uid(c.getsockname()) == os.getuid()
    assert local_uid(("203.0.113.9", 4242)) is None  # no socket of this host: a remote peer


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
def test_one_local_user_cannot_take_every_metrics_connection_from_root() -> None:
    """16 idle connections of one uid took every slot and root's scrape failed (issue 39,
    finding 9): a uid holds at most its share, and root has slots of its own besides."""
    from resild.daemon.metrics import MAX_CONNECTIONS, MAX_CONNECTIONS_PER_UID

    m = Metrics("n1")
    port = _free_port()
    m.serve(port)
    r_ready, w_ready = os.pipe()
    r_hold, w_hold = os.pipe()
    pid = os.fork()
    if pid == 0:  # the other user: every slot it can get, held idle
        try:
            os.close(r_ready)
            os.close(w_hold)
            os.setgid(65534)
            os.setuid(65534)
            held = [socket.create_connection(("127.0.0.1", port), timeout=2) for _ in range(MAX_CONNECTIONS)]
            os.write(w_ready, b"x")
            os.read(r_hold, 1)
            for s in held:
                s.close()
        finally:
            os._exit(0)
    os.close(w_ready)
    os.close(r_hold)
    try:
        assert os.read(r_ready, 1) == b"x"
        time.sleep(0.3)
        server = m._server
        assert server is not None and server._by_uid.get(65534, 0) <= MAX_CONNECTIONS_PER_UID
        assert _scrape(port) is not None, "root's scrape failed while one user held connections"
    finally:
        os.close(w_hold)
        os.waitpid(pid, 0)
        close = getattr(m, "close", None)
        if close is not None:
            close()
