"""One health source per node: the node daemon's verdict when it runs, else the same
probe set in-process.

The node process reports this node's health to the controller (HEALTH messages with
``{"verdict", "reasons", "detector"}``). Where the node daemon (`resild daemon`) runs,
it is the node's single health authority: it has the site's configuration (Xid
overrides, plug-in probes), the privileges (CAP_SYSLOG for the kernel log) and the
history since boot, so the node process subscribes to it (`DaemonHealth`) and never
opens NVML itself. Without a daemon, `InProcessHealth` builds the SAME probe set the
daemon would, from the same configuration (`resild.health.config.load_config`: RESILD_CONFIG or
/etc/resild/resild.toml, then RESILD_* variables; `resild.health.probes.build_probes`), so
Xid overrides and plug-in probes apply to jobs either way.

Which one, `open_health_source`:
- the daemon's socket is RESILD_DAEMON_SOCKET, else the config's ``status_socket``;
  when it exists and a subscription succeeds, `DaemonHealth`. A daemon that is down,
  a stale socket file or a socket the job's user may not open (group ``resild``)
  means in-process probes instead.
- in the simulated cluster (``nvml_control``: launcher/run/local.py gives each simulated
  node an NVML stand-in) the stand-in is this node's GPU, which a host daemon does not
  see: in-process, unless RESILD_DAEMON_SOCKET names a daemon explicitly.

What a job without a daemon leaves out, and why (each logged once at INFO):
- the GPU probe, when NVML cannot start (no driver, no nvidia-ml-py): the daemon calls
  that FAILED, but in a job it means "not a GPU node" (the local demo without the
  stand-in), as before this module existed. NVML that starts and then errors is
  still fail-closed.
- the kernel-log probe (``kmsg``), when the job's user cannot open ``kmsg_path``
  (dmesg_restrict: reading /dev/kmsg takes CAP_SYSLOG, which the daemon has and a job
  does not); the daemon would call it DEGRADED forever, which is blindness, not a
  fault of the node. In the simulated cluster too: the host's kernel log is not a
  simulated node's.
- a configuration that cannot be loaded (bad file, unknown probe): the daemon would
  refuse to start; a job reports "unknown" with the reason instead of dying, so the
  controller does not act on it and the error is visible.

Both call ``on_change(body)`` from a background thread each time the verdict or its
reasons change, and ``poll()`` returns the latest body (None while there is nothing
to report: no daemon and no probe applies here). Bodies never carry "node": the
caller adds its own.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import resild.wire.env as resild_env
from resild.events.schema import Detector, health_event_detector
from resild.health.config import Config, ConfigError, load_config
from resild.health.model import HealthEvent
from resild.health.probes import GpuProbe, Probe, ProbeRunner, aggregate, build_probes, start_probes, stop_probes
from resild.wire.local_socket import read_frame, send_frame, unix_path
from resild.wire.protocol import Message, MsgType, ProtocolError, Sequencer

log = logging.getLogger("resild.health_source")

DAEMON_SOCKET_ENV = resild_env.DAEMON_SOCKET.name
SUBSCRIBE_TIMEOUT_S = 1.0  # connect + first answer; a daemon slower than this is not used
RECONNECT_MIN_S, RECONNECT_MAX_S = 0.2, 5.0
DEFAULT_PUSH_INTERVAL_S = 5.0  # the daemon's keepalive period, when it does not say
SILENT_PUSHES = 3  # this many keepalives missed: the daemon is gone (or hung)
MAX_REASONS, MAX_REASON_CHARS = 64, 1024
UNKNOWN = "unknown"  # a HEALTH verdict (protocol.Health) that no probe gives: "cannot tell"

HealthBody = dict[str, Any]
OnChange = Callable[[HealthBody], None]


def _body(verdict: str, reasons: list[str], detector: str) -> HealthBody:
    """The HEALTH body a node process sends, bounded like the daemon's."""
    out = [str(r)[:MAX_REASON_CHARS] for r in reasons[:MAX_REASONS]]
    if len(reasons) > MAX_REASONS:
        out.append(f"... and {len(reasons) - MAX_REASONS} more")
    return {"verdict": verdict, "reasons": out, "detector": detector}


class HealthSource:
    """start(), poll() -> latest body or None, stop(); on_change(body) on every change."""

    detector = Detector.UNKNOWN.value

    def __init__(self, on_change: OnChange) -> None:
        self.on_change = on_change
        self._lock = threading.Lock()
        self._latest: HealthBody | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()

    def poll(self) -> HealthBody | None:
        with self._lock:
            return None if self._latest is None else dict(self._latest)

    def _publish(self, body: HealthBody) -> None:
        """Keep `body` and tell on_change, unless verdict and reasons are what they were
        (then the earlier body stays, with the detector that first saw it)."""
        key = (body["verdict"], tuple(sorted(body["reasons"])))
        with self._lock:
            old = self._latest
            if old is not None and (old["verdict"], tuple(sorted(old["reasons"]))) == key:
                return
            self._latest = body
        try:
            self.on_change(dict(body))
        except Exception:
            log.exception("health on_change callback failed")


# -- the node daemon's verdict -------------------------------------------------------


class DaemonHealth(HealthSource):
    """Subscribes to the node daemon's verdict (SUBSCRIBE_HEALTH) and forwards its pushes.

    start() subscribes in the caller's thread and raises (OSError, ProtocolError) when
    no daemon answers, so the factory can fall back. Afterwards a lost subscription
    (daemon restarted, or silent for SILENT_PUSHES keepalives) is reported as "unknown"
    and retried with backoff, forever, until stop(). Meanwhile `fallback(on_change)` (the
    factory's: the same probes in-process) runs, so "unknown" never hides an Xid: its
    verdicts are this source's until the subscription is back."""

    detector = Detector.DAEMON.value

    def __init__(
        self,
        path: str,
        on_change: OnChange,
        *,
        timeout_s: float = SUBSCRIBE_TIMEOUT_S,
        fallback: Callable[[OnChange], HealthSource] | None = None,
    ) -> None:
        super().__init__(on_change)
        self.path = path
        self.timeout_s = timeout_s
        self._fallback_factory = fallback
        self._fallback: HealthSource | None = None
        self._seq = Sequencer(f"{socket.gethostname()}/health-{os.getpid()}")
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        sock, silence_s = self._subscribe()
        self._thread = threading.Thread(target=self._run, args=(sock, silence_s), name="daemon-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._end_fallback()
        with self._lock:
            sock = self._sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # wakes the reader at once
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(2.0)

    def _subscribe(self) -> tuple[socket.socket, float]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            s.settimeout(self.timeout_s)
            s.connect(self.path)
            send_frame(s, self._seq.make(MsgType.SUBSCRIBE_HEALTH))
            msg = read_frame(s, time.monotonic() + self.timeout_s)
            if msg.type is not MsgType.HEALTH:
                raise ProtocolError(
                    str(msg.body.get("code", "unexpected")),
                    f"the daemon answered {msg.type.value}: {msg.body.get('detail', '')}",
                )
        except BaseException:
            s.close()
            raise
        interval_s = msg.body.get("push_interval_s")
        if not isinstance(interval_s, (int, float)) or not 0 < interval_s <= 600:
            interval_s = DEFAULT_PUSH_INTERVAL_S
        with self._lock:
            self._sock = s
        self._on_push(msg)
        return s, SILENT_PUSHES * float(interval_s)

    def _on_push(self, msg: Message) -> None:
        b = msg.body
        self._publish(_body(str(b["verdict"]), list(b.get("reasons") or []), self.detector))

    def _run(self, sock: socket.socket | None, silence_s: float) -> None:
        try:
            self._follow(sock, silence_s)
        except Exception:
            log.exception("health subscription thread failed")
            self._publish(_body(UNKNOWN, ["health subscription thread failed (see the node's log)"], self.detector))

    def _follow(self, sock: socket.socket | None, silence_s: float) -> None:
        backoff_s = RECONNECT_MIN_S
        while not self._stop.is_set():
            if sock is None:
                try:
                    sock, silence_s = self._subscribe()
                    backoff_s = RECONNECT_MIN_S
                    self._end_fallback()
                    log.info("health subscription to the node daemon at %s restored", self.path)
                except (OSError, ProtocolError) as e:
                    self._lost(f"no answer from the node daemon at {self.path}: {e}")
                    self._stop.wait(backoff_s)
                    backoff_s = min(2 * backoff_s, RECONNECT_MAX_S)
                    continue
            try:
                msg = read_frame(sock, time.monotonic() + silence_s)
            except (OSError, ProtocolError) as e:  # TimeoutError is an OSError
                sock.close()
                sock = None
                with self._lock:
                    self._sock = None
                if not self._stop.is_set():
                    self._lost(f"health subscription to the node daemon at {self.path} lost: {e}")
                continue
            if msg.type is MsgType.HEALTH:
                self._on_push(msg)
        if sock is not None:
            sock.close()

    def _lost(self, why: str) -> None:
        if self._fallback is not None:
            return  # the in-process probes speak until the daemon answers again
        with self._lock:
            already = self._latest is not None and self._latest["verdict"] == UNKNOWN
        if not already:
            log.warning("%s", why)
            self._publish(_body(UNKNOWN, [why], self.detector))
        if self._fallback is None and self._fallback_factory is not None and not self._stop.is_set():
            log.warning("%s: in-process health probes until it answers again", self.path)
            self._fallback = self._fallback_factory(self._from_fallback)
            self._fallback.start()

    def _from_fallback(self, body: HealthBody) -> None:
        if self._fallback is not None:  # its verdict while it stands in; none once the daemon is back
            self._publish(body)

    def _end_fallback(self) -> None:
        fb, self._fallback = self._fallback, None
        if fb is not None:
            fb.stop()


# -- the same probes, in this process -------------------------------------------------


def _event_detector(ev: HealthEvent) -> str:
    """Named like the node process's events always were ("nvml-xid"): a kernel-log Xid
    on no GPU NVML knows is "kmsg-xid"."""
    return health_event_detector(ev.kind, kernel_log=ev.gpu_index is None and ev.kind == "xid")


def _readable(path: str) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        return True
    except OSError:
        return False


class InProcessHealth(HealthSource):
    """The daemon's probe set, built from `cfg`, run here: every `interval_s` and at once
    on a probe's event (NVML, kernel log). See the module docstring for what is left out.
    `cfg` None: the configuration could not be loaded (`config_error` says why)."""

    detector = Detector.PROBE_POLL.value

    def __init__(
        self,
        cfg: Config | None,
        on_change: OnChange,
        *,
        interval_s: float | None = None,
        simulated: bool = False,
        config_error: str = "",
    ) -> None:
        super().__init__(on_change)
        self.cfg = cfg
        self.interval_s = interval_s if interval_s is not None else (cfg.probe_interval_s if cfg else 10.0)
        self.simulated = simulated
        self.config_error = config_error
        self.probes: list[Probe] = []
        self._built: list[Probe] = []
        self._runners: list[ProbeRunner] = []
        self._trigger = threading.Event()
        self._event: HealthEvent | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        cfg = self.cfg
        if cfg is None:
            self._publish(_body(UNKNOWN, [f"resild configuration: {self.config_error}"], "config"))
            return
        if "kmsg" in cfg.probes and (self.simulated or not _readable(cfg.kmsg_path)):
            log.info(
                "health: no kernel-log probe in this job (%s)",
                "simulated node"
                if self.simulated
                else f"{cfg.kmsg_path} not readable by uid {os.getuid()}; the node daemon reads it",
            )
            cfg = dataclasses.replace(cfg, probes=[p for p in cfg.probes if p != "kmsg"])
        try:
            self._built = build_probes(cfg, on_event=self._on_event, follow=True)
        except ConfigError as e:
            self._publish(_body(UNKNOWN, [f"resild configuration: {e}"], "config"))
            return
        start_probes(self._built)
        for p in self._built:
            if isinstance(p, GpuProbe) and p.nvml is None:
                why = p.check().reasons  # NVML's own words ("library not found", ...)
                log.info("health: no GPU probe (%s)", why[0] if why else "NVML unavailable")
                continue
            self.probes.append(p)
        if not self.probes:
            return
        log.info("health: in-process probes %s (no node daemon)", ", ".join(p.name for p in self.probes))
        self._runners = [ProbeRunner(p, cfg.probe_timeout_s) for p in self.probes]
        self._check(self.detector)
        self._thread = threading.Thread(target=self._loop, name="health-prober", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._trigger.set()
        if self._thread is not None and self.cfg is not None:
            self._thread.join(self.cfg.probe_timeout_s + 1)
        stop_probes(self._built)

    def _on_event(self, ev: HealthEvent) -> None:  # NVML / kmsg threads: must not block
        with self._lock:
            self._event = ev
        self._trigger.set()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._trigger.wait(self.interval_s)
            self._trigger.clear()
            with self._lock:
                ev, self._event = self._event, None
            if not self._stop.is_set():
                self._check(self.detector if ev is None else _event_detector(ev))

    EVENT_GRACE_S = 0.2

    def _check(self, detector: str) -> None:
        body = self._run_probes(detector)
        if detector == self.detector and self._changes(body) and self._trigger.wait(self.EVENT_GRACE_S):
            # A periodic check can see a fault (an Xid recorded by the NVML thread) a moment
            # before that thread reports it: the event names it, not the poll.
            self._trigger.clear()
            with self._lock:
                ev, self._event = self._event, None
            if ev is not None:
                body = self._run_probes(_event_detector(ev))
        self._publish(body)

    def _run_probes(self, detector: str) -> HealthBody:
        outcomes = {r.name: r.run() for r in self._runners}
        verdict, reasons = aggregate({n: o.result for n, o in outcomes.items()})
        return _body(verdict.value, reasons, detector)

    def _changes(self, body: HealthBody) -> bool:
        with self._lock:
            old = self._latest
        # The first check (at start) publishes at once: nothing to wait for yet.
        return old is not None and (old["verdict"], sorted(old["reasons"])) != (
            body["verdict"],
            sorted(body["reasons"]),
        )


# -- the factory ----------------------------------------------------------------------


def open_health_source(
    node: str,
    on_change: OnChange,
    nvml_control: Path | str | None = None,
    *,
    interval_s: float | None = None,
    env: Mapping[str, str] | None = None,
) -> HealthSource:
    """The node's one health source, started. Never raises for a missing daemon, NVML or
    configuration (see the module docstring); `interval_s` paces in-process checks."""
    env = os.environ if env is None else env
    cfg: Config | None = None
    error = ""
    try:
        cfg = load_config(env=env)
        cfg.node = node
    except ConfigError as e:
        error = str(e)
        log.error("health: cannot load the resild configuration: %s", e)
    explicit = env.get(DAEMON_SOCKET_ENV, "")
    path = explicit or unix_path((cfg or Config()).status_endpoint) or ""
    if nvml_control is not None and not explicit:
        log.info("%s: simulated node with an NVML stand-in: in-process health probes", node)
    elif path and os.path.exists(path):

        def in_process(cb: OnChange) -> HealthSource:  # while the daemon does not answer
            return InProcessHealth(cfg, cb, interval_s=interval_s, simulated=False, config_error=error)

        daemon = DaemonHealth(path, on_change, fallback=in_process)
        try:
            daemon.start()
            log.info("%s: health from the node daemon at %s", node, path)
            return daemon
        except (OSError, ProtocolError) as e:
            log.warning("%s: node daemon at %s unusable (%s): in-process health probes", node, path, e)
    source = InProcessHealth(
        cfg, on_change, interval_s=interval_s, simulated=nvml_control is not None, config_error=error
    )
    source.start()
    return source
