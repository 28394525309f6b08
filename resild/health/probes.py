"""Probe plug-ins: the interface, the built-ins, loading, and fail-closed running.

A probe is any object with a ``name`` and ``check() -> ProbeResult``; it may
also have ``start()`` and ``stop()``. Third-party probes register a factory
``make_probe(options: dict) -> Probe`` under the entry-point group
``resild.probes``; ``options`` is the ``[probe_options.<name>]`` config table.

Fail closed: a probe that raises, or does not answer within its timeout, is
FAILED — never healthy. A probe still stuck in its previous check is not run
again (that would pile up threads); it stays FAILED until it returns.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from resild.health.config import Config, ConfigError
from resild.health.kmsg import KmsgFollower, KmsgXid, parse_xid_line, pci_bus_key
from resild.health.model import GpuStatus, HealthEvent, Verdict, worst
from resild.health.nvml_codes import CLOCK_EVENT_HOLD_S
from resild.health.nvml_probe import NvmlProbe, NvmlUnavailable
from resild.health.verdict import node_verdict
from resild.health.xid import classify_xid

log = logging.getLogger(__name__)
ENTRY_POINT_GROUP = "resild.probes"


@dataclass
class ProbeResult:
    verdict: Verdict
    reasons: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict.value, "reasons": list(self.reasons), "details": self.details}


@runtime_checkable
class Probe(Protocol):
    name: str

    def check(self) -> ProbeResult: ...


ProbeFactory = Callable[[Mapping[str, Any]], Probe]
EventSink = Callable[[HealthEvent], None]


# -- running, fail closed ---------------------------------------------------------


@dataclass
class Outcome:
    result: ProbeResult
    latency_s: float
    error: bool  # raised, timed out, or still stuck: counted in metrics


class ProbeRunner:
    """Runs one probe's check() on a worker thread with a deadline."""

    def __init__(self, probe: Probe, timeout_s: float) -> None:
        self.probe = probe
        self.timeout_s = timeout_s
        self._busy: threading.Thread | None = None

    @property
    def name(self) -> str:
        return str(getattr(self.probe, "name", type(self.probe).__name__))

    def run(self) -> Outcome:
        t0 = time.monotonic()
        if self._busy is not None and self._busy.is_alive():
            return Outcome(
                ProbeResult(Verdict.FAILED, [f"probe {self.name} is still stuck in its previous check"]), 0.0, True
            )
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["result"] = self.probe.check()
            except BaseException as e:
                box["error"] = e

        t = threading.Thread(target=call, name=f"probe:{self.name}", daemon=True)
        try:
            t.start()
        except Exception as err:  # e.g. "can't start new thread" at the task limit: fail closed
            return Outcome(
                ProbeResult(Verdict.FAILED, [f"probe {self.name} could not run: {type(err).__name__}: {err}"]),
                time.monotonic() - t0,
                True,
            )
        t.join(self.timeout_s)
        latency_s = time.monotonic() - t0
        if t.is_alive():
            self._busy = t
            return Outcome(
                ProbeResult(Verdict.FAILED, [f"probe {self.name} timed out after {self.timeout_s:g}s"]), latency_s, True
            )
        if "error" in box:
            e = box["error"]
            return Outcome(
                ProbeResult(Verdict.FAILED, [f"probe {self.name} raised {type(e).__name__}: {e}"]), latency_s, True
            )
        res = box.get("result")
        if not isinstance(res, ProbeResult) or not isinstance(res.verdict, Verdict):
            return Outcome(
                ProbeResult(Verdict.FAILED, [f"probe {self.name} returned {type(res).__name__}, not a ProbeResult"]),
                latency_s,
                True,
            )
        return Outcome(res, latency_s, False)


def aggregate(results: Mapping[str, ProbeResult]) -> tuple[Verdict, list[str]]:
    """Node verdict: the worst probe verdict, with every unhealthy probe's reasons."""
    verdict = worst(*(r.verdict for r in results.values()))
    reasons = [
        reason
        for r in results.values()
        if r.verdict is not Verdict.HEALTHY
        for reason in (r.reasons or [r.verdict.value])
    ]
    return verdict, reasons


def fault_summary(results: Mapping[str, ProbeResult]) -> str:
    """One short phrase for a Slurm drain reason, e.g. 'GPU 3 Xid 79 GPU has fallen off the bus'."""
    verdict, reasons = aggregate(results)
    gpu = results.get("gpu")
    if gpu is not None and gpu.verdict is verdict:
        for st in gpu.details.get("gpus", []):
            if st.get("verdict") == verdict.value:
                xid = st.get("last_xid")
                for reason in st.get("reasons") or []:
                    if xid is not None and reason.startswith(f"Xid {xid} ("):
                        desc = reason[len(f"Xid {xid} (") :].split(")", 1)[0]
                        return f"GPU {st['index']} Xid {xid} {desc}"
                return f"GPU {st['index']} {(st.get('reasons') or [verdict.value])[0]}"
    return reasons[0] if reasons else verdict.value


# -- built-in: GPU via NVML ---------------------------------------------------------


class GpuProbe:
    """NvmlProbe as a Probe. NVML events reach ``on_event`` at once (the daemon
    re-checks on them); check() polls the counters. NVML that cannot start is
    FAILED, retried at every check (the driver may load later)."""

    name = "gpu"

    def __init__(
        self,
        xid_overrides: Mapping[str, str] | None = None,
        call_timeout_s: float = 2.0,
        init_timeout_s: float = 10.0,
        on_event: EventSink | None = None,
        nvml: Any = None,
        clock_event_hold_s: float = CLOCK_EVENT_HOLD_S,
    ) -> None:
        self._overrides = dict(xid_overrides or {})
        self._clock_event_hold_s = clock_event_hold_s
        self._call_timeout_s = call_timeout_s
        self._init_timeout_s = init_timeout_s
        self._on_event = on_event
        self._nvml_module = nvml
        self._lock = threading.Lock()
        self.nvml: NvmlProbe | None = None
        self._error = "not started"
        self._bus_keys: set[str] = set()

    def start(self) -> None:
        with self._lock:
            if self.nvml is not None:
                return
            p = NvmlProbe(
                nvml=self._nvml_module,
                xid_overrides=self._overrides,
                call_timeout_s=self._call_timeout_s,
                on_event=self._on_event,
                init_timeout_s=self._init_timeout_s,
                clock_event_hold_s=self._clock_event_hold_s,
            )
            try:
                p.start()
            except NvmlUnavailable as e:
                self._error = str(e)
                return
            self._bus_keys = _bus_keys(p.poll())
            self.nvml = p

    def stop(self) -> None:
        with self._lock:
            if self.nvml is not None:
                self.nvml.stop()
                self.nvml = None

    def bus_keys(self) -> set[str]:
        return self._bus_keys if self.nvml is not None else set()

    def check(self) -> ProbeResult:
        self.start()
        if self.nvml is None:
            return ProbeResult(Verdict.FAILED, [self._error], {"gpus": []})
        statuses: list[GpuStatus] = self.nvml.poll()
        verdict, reasons = node_verdict(statuses)
        return ProbeResult(
            verdict,
            reasons,
            {
                "gpus": [s.to_dict() for s in statuses],
                "driver": self.nvml.driver_version,
                "events_enabled": self.nvml.events_enabled,
            },
        )


def _bus_keys(statuses: Iterable[GpuStatus]) -> set[str]:
    keys: set[str] = set()
    for st in statuses:
        try:
            keys.add(pci_bus_key(st.pci_bus_id or ""))
        except ValueError:
            pass
    return keys


# -- built-in: Xid lines in the kernel log -------------------------------------------


class KmsgXidProbe:
    """Xids in the kernel log: the buffer since boot at start(), then new lines.

    An Xid on a GPU the GPU probe knows goes to that probe (it shows in the
    GPU's row, deduplicated against NVML's own event); any other Xid is judged
    here. A log that cannot be read is DEGRADED: blind, but not a GPU fault.
    """

    name = "kmsg"
    MAX_SCAN_BYTES = 4 << 20

    def __init__(
        self,
        path: str,
        xid_overrides: Mapping[str, str] | None = None,
        gpu: GpuProbe | None = None,
        follow: bool = False,
        on_event: EventSink | None = None,
    ) -> None:
        self.path = path
        self._overrides = dict(xid_overrides or {})
        self._gpu = gpu
        self._follow = follow
        self._on_event = on_event
        self._lock = threading.Lock()
        self._findings: dict[tuple[str, int], tuple[Verdict, str]] = {}
        self._seen: list[dict[str, Any]] = []
        self._error: str | None = None
        self._follower: KmsgFollower | None = None
        self._started = False

    def start(self) -> None:
        if self._started:
            return
        self._started = True
        try:
            for line in _read_existing(self.path, self.MAX_SCAN_BYTES):
                if (xid := parse_xid_line(line)) is not None:
                    self._on_xid(xid, live=False)
        except OSError as e:
            self._error = f"cannot read kernel log {self.path}: {e.strerror or e}"
            return
        if self._follow:
            self._follower = KmsgFollower(self.path, on_xid=self._on_xid, on_error=self._on_follow_error)
            self._follower.start()

    def stop(self) -> None:
        if self._follower is not None:
            self._follower.stop()

    def _on_follow_error(self, exc: BaseException) -> None:
        self._error = f"following kernel log {self.path}: {exc}"

    def _on_xid(self, xid: KmsgXid, live: bool = True) -> None:
        gpu = self._gpu
        gpu_nvml = gpu.nvml if gpu is not None else None
        try:
            key = pci_bus_key(xid.pci_bus_id)
        except ValueError:
            key = xid.pci_bus_id
        with self._lock:
            self._seen.append({"pci_bus_id": xid.pci_bus_id, "xid": xid.xid, "message": xid.message})
            del self._seen[:-32]
        if gpu is not None and gpu_nvml is not None and key in gpu.bus_keys():
            gpu_nvml.ingest_kmsg_xid(xid)  # emits its own HealthEvent
            return
        xc = classify_xid(xid.xid, self._overrides)
        reason = f"PCI {xid.pci_bus_id}: {xc.reason} (kernel log)"
        with self._lock:
            self._findings[(key, xid.xid)] = (xc.verdict, reason)
        if live and self._on_event is not None and xc.verdict is not Verdict.HEALTHY:
            self._on_event(
                HealthEvent(
                    None,
                    "xid",
                    xid.xid,
                    xc.verdict,
                    reason,
                    time.monotonic(),
                    time.time(),
                    xid_class=xc.health_class.value,
                    action=xc.action,
                )
            )

    def check(self) -> ProbeResult:
        self.start()
        with self._lock:
            found = list(self._findings.values())
            details = {"recent_xids": list(self._seen)}
        reasons = [r for v, r in found if v is not Verdict.HEALTHY]
        verdict = worst(*(v for v, _ in found))
        if self._error:
            verdict = worst(verdict, Verdict.DEGRADED)
            reasons.append(self._error)
        return ProbeResult(verdict, reasons, details)


def _read_existing(path: str, limit: int) -> Iterable[str]:
    """Lines already in the log: /dev/kmsg yields one record per read until EAGAIN."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    lines: list[str] = []
    total = 0
    try:
        while total < limit:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno == 32:  # EPIPE: ring buffer overrun, keep reading
                    continue
                raise
            if not chunk:
                break
            total += len(chunk)
            text = chunk.decode("utf-8", "replace")
            # kmsg records: "prefix;message\n KEY=value..."; a plain file: lines.
            lines.extend(line for line in text.split("\n") if line and not line.startswith(" "))
    finally:
        os.close(fd)
    return lines


# -- loading -------------------------------------------------------------------------


class _BrokenProbe:
    """Stands in for a probe that could not be loaded or built: always FAILED."""

    def __init__(self, name: str, why: str) -> None:
        self.name = name
        self._why = why

    def check(self) -> ProbeResult:
        return ProbeResult(Verdict.FAILED, [f"probe {self.name} unusable: {self._why}"])


def plugin_factories() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)}


BUILTIN_PROBES = ("gpu", "kmsg")


def build_probes(cfg: Config, *, on_event: EventSink | None = None, follow: bool = False) -> list[Probe]:
    """The configured probes, in config order (the GPU probe first: kmsg feeds it).

    An unknown name is a ConfigError (a typo must not silently drop a check);
    a plug-in that fails to import or build becomes a probe that is always FAILED.
    """
    plugins = plugin_factories()
    for name in cfg.probes:
        if name not in BUILTIN_PROBES and name not in plugins:
            known = ", ".join(sorted({*BUILTIN_PROBES, *plugins}))
            raise ConfigError("probes", f"unknown probe '{name}' (available: {known})")
    names = sorted(cfg.probes, key=lambda n: n != "gpu")
    probes: list[Probe] = []
    gpu: GpuProbe | None = None
    for name in dict.fromkeys(names):
        opts = dict(cfg.probe_options.get(name, {}))
        if name == "gpu":
            gpu = GpuProbe(
                cfg.xid_overrides,
                cfg.nvml_call_timeout_s,
                init_timeout_s=cfg.probe_timeout_s,
                on_event=on_event,
                clock_event_hold_s=cfg.clock_event_hold_s,
            )
            probes.append(gpu)
        elif name == "kmsg":
            probes.append(KmsgXidProbe(cfg.kmsg_path, cfg.xid_overrides, gpu, follow, on_event))
        else:
            try:
                probe = plugins[name].load()(opts)
                if not isinstance(probe, Probe):
                    raise TypeError(f"factory returned {type(probe).__name__}, not a Probe")
                probes.append(probe)
            except Exception as e:
                log.error("probe %s cannot be loaded: %s", name, e)
                probes.append(_BrokenProbe(name, f"{type(e).__name__}: {e}"))
    return probes


def start_probes(probes: Iterable[Probe]) -> None:
    """Start each probe that has start(); one that raises is left to fail its checks."""
    for p in probes:
        start = getattr(p, "start", None)
        if start is None:
            continue
        try:
            start()
        except Exception as e:
            log.error("probe %s failed to start: %s", getattr(p, "name", p), e)


def stop_probes(probes: Iterable[Probe]) -> None:
    for p in probes:
        stop = getattr(p, "stop", None)
        if stop is not None:
            try:
                stop()
            except Exception:
                log.exception("probe %s failed to stop", getattr(p, "name", p))


def run_all(runners: Iterable[ProbeRunner]) -> dict[str, Outcome]:
    return {r.name: r.run() for r in runners}
