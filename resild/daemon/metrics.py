"""Prometheus metrics of the node agent (prometheus-client, own registry).

Verdicts are exported as numbers (0 healthy, 1 degraded, 2 failed) so that
alerts can say `max by (node) (resild_node_verdict) == 2`.

The endpoint is a bounded server, not prometheus-client's start_http_server: that one
starts a thread per connection and never times a connection out, so 3,000 idle
connections made ~2,900 threads and the daemon's prober could no longer start its own.
Here at most MAX_CONNECTIONS are served at once (more are closed at once) and each
socket operation times out after SOCKET_TIMEOUT_S; the exposition is prometheus-client's.
A local client's uid (the kernel's socket table, `local_uid`) holds at most
MAX_CONNECTIONS_PER_UID of them, and root and the daemon's own uid have
MAX_PRIVILEGED_CONNECTIONS of their own: one local user cannot take every slot and fail
root's scrape (issue 39).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app

from resild.health.model import HealthEvent, Verdict
from resild.health.probes import Outcome

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 16  # a scraper or two at a time is the norm
SOCKET_TIMEOUT_S = 5.0  # per socket operation: an idle connection is closed after this
# A whole connection's deadline: a byte per SOCKET_TIMEOUT_S would otherwise hold a slot forever.
MAX_CONNECTION_S = 30.0
MAX_CONNECTIONS_PER_UID = 4  # one local user's share of MAX_CONNECTIONS
MAX_PRIVILEGED_CONNECTIONS = 4  # root's and the daemon uid's, outside MAX_CONNECTIONS
_PRIVILEGED = frozenset({0, os.geteuid()})


def _proc_addr(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} prints it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def local_uid(client_address: Any, tables: tuple[str, ...] = ("/proc/net/tcp", "/proc/net/tcp6")) -> int | None:
    """The uid owning a TCP client socket on this host (None: not found, a remote peer)."""
    try:
        ip, port = ipaddress.ip_address(client_address[0]), int(client_address[1])
    except (ValueError, TypeError, IndexError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for table in tables:
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) < 8:
                        continue
                    addr, _, hex_port = fields[1].rpartition(":")
                    if int(hex_port, 16) != port:
                        continue
                    mine = _proc_addr(addr)
                    if isinstance(mine, ipaddress.IPv6Address) and mine.ipv4_mapped is not None:
                        mine = mine.ipv4_mapped
                    if mine == ip:
                        return int(fields[7])
        except (OSError, ValueError):
            continue
    return None


class _QuietHandler(WSGIRequestHandler):
    timeout = SOCKET_TIMEOUT_S  # StreamRequestHandler.setup() applies it to the connection

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per scrape on stderr is noise in the journal


class BoundedMetricsServer(ThreadingMixIn, WSGIServer):
    """WSGIServer with one thread per connection, but at most `max_connections` of them:
    a connection beyond that is closed at once instead of getting a thread."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 128  # socketserver's 5 makes a burst of connects wait on SYN retries

    def __init__(
        self, addr: str, port: int, max_connections: int = MAX_CONNECTIONS, max_connection_s: float = MAX_CONNECTION_S
    ) -> None:
        infos = socket.getaddrinfo(addr or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        self.address_family = infos[0][0]
        self._slots = threading.BoundedSemaphore(max_connections)
        self._privileged_slots = threading.BoundedSemaphore(MAX_PRIVILEGED_CONNECTIONS)
        self._by_uid: dict[int | None, int] = {}  # open connections per local uid (None: remote)
        self._slot_of: dict[socket.socket, tuple[threading.BoundedSemaphore, int | None]] = {}
        self.max_connection_s = max_connection_s
        self._started: dict[socket.socket, float] = {}  # open connections -> since (monotonic)
        self._started_lock = threading.Lock()
        self.refused = 0
        super().__init__((addr, port), _QuietHandler)

    def process_request(self, request: Any, client_address: Any) -> None:
        uid = local_uid(client_address)
        slots: threading.BoundedSemaphore | None = None
        if uid in _PRIVILEGED:  # the shared slots first, then its own
            for s in (self._slots, self._privileged_slots):
                if s.acquire(blocking=False):
                    slots = s
                    break
        else:
            with self._started_lock:
                over = uid is not None and self._by_uid.get(uid, 0) >= MAX_CONNECTIONS_PER_UID
            if not over and self._slots.acquire(blocking=False):
                slots = self._slots
        if slots is None:
            self.refused += 1
            self.shutdown_request(request)
            return
        with self._started_lock:
            self._started[request] = time.monotonic()
            self._by_uid[uid] = self._by_uid.get(uid, 0) + 1
            self._slot_of[request] = (slots, uid)
        try:
            super().process_request(request, client_address)  # starts the thread
        except Exception as e:  # no thread (the task limit): the slot is free again
            self._release(request)
            log.warning("metrics: cannot serve a connection: %s", e)
            self.shutdown_request(request)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request: socket.socket) -> None:
        with self._started_lock:
            self._started.pop(request, None)
            slots, uid = self._slot_of.pop(request, (None, None))
            if slots is not None:
                self._by_uid[uid] -= 1
                if not self._by_uid[uid]:
                    del self._by_uid[uid]
        if slots is not None:
            slots.release()

    def service_actions(self) -> None:
        """From serve_forever's loop (every poll interval): cut connections past their
        deadline; the handler's next read then ends, and its thread frees the slot."""
        now = time.monotonic()
        with self._started_lock:
            late = [r for r, t0 in self._started.items() if now - t0 > self.max_connection_s]
        for request in late:
            with contextlib.suppress(OSError):
                request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Timeouts and resets of scrapers are routine: no traceback on stderr.
        log.debug("metrics: connection from %s ended in an error", client_address, exc_info=True)


class Metrics:
    def __init__(self, node: str) -> None:
        self.node = node
        self._server: BoundedMetricsServer | None = None
        self.registry = CollectorRegistry()
        r = self.registry
        self.node_verdict = Gauge(
            "resild_node_verdict", "Node verdict: 0 healthy, 1 degraded, 2 failed", ["node"], registry=r
        )
        self.gpu_verdict = Gauge(
            "resild_gpu_verdict", "GPU verdict: 0 healthy, 1 degraded, 2 failed", ["node", "gpu", "uuid"], registry=r
        )
        self.gpu_ecc = Gauge(
            "resild_gpu_ecc_uncorrected", "Uncorrected volatile ECC errors", ["node", "gpu"], registry=r
        )
        self.gpu_temp = Gauge("resild_gpu_temperature_celsius", "GPU temperature", ["node", "gpu"], registry=r)
        self.xids = Counter("resild_xid", "Xid events seen, by GPU and code", ["node", "gpu", "code"], registry=r)
        self.probe_latency = Histogram(
            "resild_probe_latency_seconds",
            "Probe check latency",
            ["node", "probe"],
            registry=r,
            buckets=(0.001, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30),
        )
        self.probe_errors = Counter(
            "resild_probe_errors", "Probe checks that raised or timed out", ["node", "probe"], registry=r
        )
        self.probe_verdict = Gauge("resild_probe_verdict", "Probe verdict: 0/1/2", ["node", "probe"], registry=r)
        self.heartbeat_age = Gauge(
            "resild_heartbeat_age_seconds",
            "Seconds since the last heartbeat sent to the controller",
            ["node"],
            registry=r,
        )
        self.watched = Gauge(
            "resild_watched_processes", "Watched training processes by state", ["node", "state"], registry=r
        )

    def serve(self, port: int, addr: str = "127.0.0.1", max_connections: int = MAX_CONNECTIONS) -> int:
        """Serve /metrics on addr:port (0: any free port) in a thread; returns the port."""
        server = BoundedMetricsServer(addr, port, max_connections, MAX_CONNECTION_S)
        server.set_app(make_wsgi_app(self.registry))
        threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
        self._server = server
        return int(server.server_address[1])

    def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    def on_outcomes(self, outcomes: Mapping[str, Outcome]) -> None:
        for name, o in outcomes.items():
            self.probe_latency.labels(self.node, name).observe(o.latency_s)
            self.probe_verdict.labels(self.node, name).set(o.result.verdict.severity)
            if o.error:
                self.probe_errors.labels(self.node, name).inc()
        gpu = outcomes.get("gpu")
        if gpu is not None:
            self.on_gpus(gpu.result.details.get("gpus", []))

    def on_gpus(self, gpus: list[dict[str, Any]]) -> None:
        for st in gpus:
            idx = str(st["index"])
            self.gpu_verdict.labels(self.node, idx, st.get("uuid") or "").set(Verdict(st["verdict"]).severity)
            if st.get("ecc_uncorrected") is not None:
                self.gpu_ecc.labels(self.node, idx).set(st["ecc_uncorrected"])
            if st.get("temperature_c") is not None:
                self.gpu_temp.labels(self.node, idx).set(st["temperature_c"])

    def on_event(self, ev: HealthEvent) -> None:
        if ev.kind == "xid" and ev.code is not None:
            gpu = "" if ev.gpu_index is None else str(ev.gpu_index)
            self.xids.labels(self.node, gpu, str(ev.code)).inc()

    def on_node(self, verdict: Verdict) -> None:
        self.node_verdict.labels(self.node).set(verdict.severity)
