"""GPU health from NVML: event thread (Xid, ECC, lost GPU) plus periodic counter reads.

Principles:
- Fail closed. A read that errors or does not return within ``call_timeout_s``
  makes the GPU FAILED ("probe error" / "probe timeout"); it never reads as
  HEALTHY. A function the driver lacks (FunctionNotFound / NotSupported) only
  drops that metric.
- Events first. Xid / double-bit ECC / GPU-unavailable / recovery-action events
  reach ``on_event`` the moment NVML delivers them; ``poll()`` covers what has no
  event (counters, NVLink state, clocks) and what happened before registration.
- One lock around NVML calls, each run on a worker thread with a deadline, so a
  call wedged in the driver is abandoned instead of wedging the daemon. The
  exception is nvmlEventSetWait_v2: it blocks by design and NVML documents it
  thread-safe, so it runs on the event thread outside the lock.
- Findings from events (Xid, DBE, lost GPU) are sticky for the probe's life:
  recovering from them takes a GPU reset or reboot, which restarts the daemon.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from resild.health.deadline import CallTimeout, DeadlineRunner
from resild.health.kmsg import KmsgXid, pci_bus_key
from resild.health.model import GpuStatus, HealthEvent, RemapStatus, Verdict, worst
from resild.health.nvml_codes import (
    CLOCK_EVENT_HOLD_S,
    CLOCK_EVENT_NAMES,
    EVENT_DOUBLE_BIT_ECC,
    EVENT_GPU_UNAVAILABLE,
    EVENT_RECOVERY_ACTION,
    EVENT_XID,
    FIELD_GPU_RECOVERY_ACTION,
    FUNCTION_NOT_FOUND,
    GPU_IDLE,
    INVALID_ARGUMENT,
    LOST_CODES,
    MEMORY_ERROR_UNCORRECTED,
    NOT_SUPPORTED,
    TEMPERATURE_GPU,
    TIMEOUT,
    VOLATILE_ECC,
    WATCHED_EVENTS,
    XID_DEDUP_WINDOW_S,
    as_text,
    describe_error,
    field_value,
    handle_key,
)
from resild.health.nvml_trends import ClockHold, ReplayRate, pcie_shortfall
from resild.health.xid import (
    XID_RECOVERY_ACTION_CHANGED,
    XidOverrides,
    classify_recovery_action,
    classify_xid,
    validate_overrides,
)

log = logging.getLogger(__name__)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used at all: binding or library missing, driver not loaded."""


class _Missing(Exception):
    """The binding has no such function (older nvidia-ml-py)."""


class _Abort(Exception):
    """Stop reading this GPU for this poll (it is lost or wedged)."""


class _NoError(Exception):
    pass


_SKIP = object()  # a read returned nothing usable (metric unsupported or failed)


@dataclass(frozen=True)
class _Finding:
    key: str  # identity, for reporting each problem once
    kind: str
    code: int | None
    verdict: Verdict
    reason: str


@dataclass
class _Gpu:
    index: int
    handle: Any = None
    addr: Any = None  # identity of the handle (see handle_key)
    uuid: str | None = None
    name: str | None = None
    pci_bus_id: str | None = None
    sticky: dict[str, _Finding] = field(default_factory=dict)
    reported: set[str] = field(default_factory=set)
    last_xid: int | None = None
    last_xid_wall: float | None = None
    xid_seen_mono: dict[int, float] = field(default_factory=dict)
    nvlinks: list[int] | None = None  # None: not scanned yet
    unsupported: set[str] = field(default_factory=set)
    replays: ReplayRate = field(default_factory=ReplayRate)
    clocks: ClockHold | None = None  # made at the first clock-event read (the probe's hold_s)

    @property
    def lost(self) -> bool:
        return "gpu_lost" in self.sticky


class NvmlProbe:
    """NVML-based GPU health for one node. See the module docstring.

    ``nvml``: a module with the nvidia-ml-py API; None imports ``pynvml``.
    ``xid_overrides``: config overrides of the Xid table, e.g. ``{43: "degraded"}``.
    ``on_event``: called from the probe's threads, at once, for every health
    event; it must not block for long (it may call ``poll()``).
    ``event_wait_s``: how long one event wait blocks (bounds ``stop()``).
    ``clock_event_hold_s``: how long hardware clock slowdowns must hold (at least
    CLOCK_EVENT_DUTY of the polls) before they degrade the GPU; 0: at the first read.
    """

    def __init__(
        self,
        nvml: Any = None,
        xid_overrides: XidOverrides | None = None,
        call_timeout_s: float = 2.0,
        on_event: Callable[[HealthEvent], None] | None = None,
        *,
        event_wait_s: float = 0.5,
        init_timeout_s: float = 30.0,
        clock_event_hold_s: float = CLOCK_EVENT_HOLD_S,
    ) -> None:
        self._nvml = nvml
        self._clock_event_hold_s = clock_event_hold_s
        self._overrides = validate_overrides(xid_overrides)  # bad config fails here
        self._call_timeout_s = call_timeout_s
        self._on_event = on_event
        self._event_wait_s = event_wait_s
        self._init_timeout_s = init_timeout_s
        self._nvml_error: type[BaseException] = _NoError
        self._calls = DeadlineRunner("nvml-call")  # the one lock around NVML calls
        self._state_lock = threading.RLock()  # around per-GPU bookkeeping
        self._poll_lock = threading.RLock()
        self._gpus: list[_Gpu] = []
        self._by_addr: dict[Any, _Gpu] = {}
        self._by_bus: dict[str, _Gpu] = {}
        self._event_set: Any = None
        self._event_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._initialised = False
        self._started = False
        self.driver_version: str | None = None
        self.events_enabled = False
        self.recent_events: deque[HealthEvent] = deque(maxlen=256)

    # -- lifecycle ------------------------------------------------------------

    def start(self) -> None:
        """Init NVML, enumerate GPUs, register events, read the baseline, start the event thread.

        Raises NvmlUnavailable when NVML cannot be used at all.
        """
        if self._started or self._initialised:
            raise RuntimeError("NvmlProbe already started")
        if self._stop.is_set():
            raise RuntimeError("NvmlProbe cannot be restarted: create a new one")
        if self._nvml is None:
            try:
                import pynvml
            except ImportError as e:
                raise NvmlUnavailable(
                    "NVML unavailable: the nvidia-ml-py package (module pynvml) is not installed"
                ) from e
            self._nvml = pynvml
        self._nvml_error = getattr(self._nvml, "NVMLError", _NoError)
        try:
            self._call(None, "nvmlInit", timeout_s=self._init_timeout_s)
        except CallTimeout as e:
            raise NvmlUnavailable(f"NVML unavailable: nvmlInit hung ({e})") from None
        except Exception as e:
            raise NvmlUnavailable(
                f"NVML unavailable: nvmlInit failed: {describe_error(e)}. Is the NVIDIA driver "
                f"loaded and libnvidia-ml.so.1 on the library path?"
            ) from e
        self._initialised = True
        try:
            self._enumerate()
            self._register_events()
            for g in self._gpus:
                self._scan_nvlinks_safely(g)
            self._started = True
            # Baseline: events from before registration are lost, so whatever
            # they left behind must show up in the counters now.
            self.poll()
            if self.events_enabled:
                self._event_thread = threading.Thread(target=self._event_loop, name="nvml-events", daemon=True)
                self._event_thread.start()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop the event thread and shut NVML down (best effort, never raises)."""
        self._stop.set()
        thread_done = True
        if self._event_thread is not None:
            self._event_thread.join(self._event_wait_s + self._call_timeout_s + 1.0)
            thread_done = not self._event_thread.is_alive()
        if self._event_set is not None and thread_done:
            # Freeing a set a hung wait still uses would be worse than leaking it.
            self._quiet_call("nvmlEventSetFree", self._event_set)
            self._event_set = None
        if self._initialised:
            self._quiet_call("nvmlShutdown")
            self._initialised = False
        self._started = False
        self._calls.close()

    def __enter__(self) -> NvmlProbe:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def gpu_count(self) -> int:
        return len(self._gpus)

    # -- polling --------------------------------------------------------------

    def poll(self) -> list[GpuStatus]:
        """Read every GPU's counters now; returns fresh statuses (copies)."""
        if not self._started:
            raise RuntimeError("NvmlProbe.poll() before start()")
        statuses: list[GpuStatus] = []
        with self._poll_lock:
            for g in self._gpus:
                status, events = self._poll_gpu(g)
                self._emit(events)
                statuses.append(status)
        return statuses

    def _poll_gpu(self, g: _Gpu) -> tuple[GpuStatus, list[HealthEvent]]:
        st = GpuStatus(index=g.index, uuid=g.uuid, pci_bus_id=g.pci_bus_id, name=g.name)
        found: list[_Finding] = []
        if not g.lost and g.handle is not None:
            try:
                self._read_all(g, st, found)
            except _Abort:
                pass
        t_mono, t_wall = time.monotonic(), time.time()
        with self._state_lock:
            findings = list(g.sticky.values()) + found
            st.verdict = worst(*(f.verdict for f in findings))
            st.reasons = [f.reason for f in findings if f.verdict is not Verdict.HEALTHY]
            st.last_xid, st.last_xid_wall = g.last_xid, g.last_xid_wall
            new = [f for f in found if f.verdict is not Verdict.HEALTHY and f.key not in g.reported]
            # Forget what cleared, so it is reported again if it comes back.
            g.reported = {f.key for f in findings}
        events = [self._event(g.index, f.kind, f.code, f.verdict, f.reason, t_mono, t_wall) for f in new]
        return copy.deepcopy(st), events

    def _read_all(self, g: _Gpu, st: GpuStatus, found: list[_Finding]) -> None:
        h = g.handle
        if (v := self._read(g, found, "nvmlDeviceGetTemperature", h, TEMPERATURE_GPU)) is not _SKIP:
            st.temperature_c = int(v)
        if (v := self._read(g, found, "nvmlDeviceGetPowerUsage", h)) is not _SKIP:
            st.power_w = int(v) / 1000.0
        v = self._read(g, found, "nvmlDeviceGetTotalEccErrors", h, MEMORY_ERROR_UNCORRECTED, VOLATILE_ECC)
        if v is not _SKIP:
            st.ecc_uncorrected = int(v)
            if st.ecc_uncorrected > 0:
                # Degraded, not failed: after a contained error (Xid 94) the GPU
                # keeps working until its rows are remapped at the next reset.
                # A new count is a new finding, so every increase is reported.
                found.append(
                    _Finding(
                        f"ecc_uncorrected:{st.ecc_uncorrected}",
                        "ecc_uncorrected",
                        st.ecc_uncorrected,
                        Verdict.DEGRADED,
                        f"{st.ecc_uncorrected} uncorrected ECC errors since driver load",
                    )
                )
        if (v := self._read(g, found, "nvmlDeviceGetRemappedRows", h)) is not _SKIP:
            corr, unc, pending, failure = (int(x) for x in v)
            st.remap = RemapStatus(corr, unc, bool(pending), bool(failure))
            if failure:
                found.append(
                    _Finding(
                        "remap_failure",
                        "remap_failure",
                        None,
                        Verdict.FAILED,
                        "row remapping failed (like Xid 64): reset GPU",
                    )
                )
            elif pending:
                found.append(
                    _Finding(
                        "remap_pending",
                        "remap_pending",
                        None,
                        Verdict.DEGRADED,
                        "row remap pending: reset GPU when convenient",
                    )
                )
        if g.nvlinks is None:
            self._scan_nvlinks(g, found)
        for link in g.nvlinks or []:
            v = self._read(g, found, "nvmlDeviceGetNvLinkState", h, link, cache_unsupported=False)
            if v is not _SKIP and not v:
                st.nvlink_down.append(link)
                found.append(
                    _Finding(f"nvlink_down:{link}", "nvlink_down", link, Verdict.FAILED, f"NVLink {link} down")
                )
        if (v := self._read(g, found, "nvmlDeviceGetPcieReplayCounter", h)) is not _SKIP:
            st.pcie_replays = int(v)
            if (t := g.replays.read(time.monotonic(), st.pcie_replays)) is not None:
                found.append(_Finding(t.key, "pcie_replay", t.code, Verdict.DEGRADED, t.reason))
        mask = None
        if (v := self._read_clock_events(g, found)) is not _SKIP:
            mask = int(v)
            st.throttle_reasons = [n for bit, n in CLOCK_EVENT_NAMES.items() if mask & bit]
            if g.clocks is None:
                g.clocks = ClockHold(self._clock_event_hold_s)
            if (t := g.clocks.read(time.monotonic(), mask)) is not None:
                found.append(_Finding(t.key, "clock_event", t.code, Verdict.DEGRADED, t.reason))
        self._read_pcie_link(g, st, found, idle=mask is not None and bool(mask & GPU_IDLE))
        action = self._read_recovery_action(g, found)
        if action is not None:
            st.recovery_action = action
            verdict, reason = classify_recovery_action(action)
            if verdict is not Verdict.HEALTHY:
                found.append(_Finding(f"recovery_action:{action}", "recovery_action", action, verdict, reason))

    def _read_pcie_link(self, g: _Gpu, st: GpuStatus, found: list[_Finding], idle: bool) -> None:
        """The PCIe link against its maximum (GPU and slot): fewer lanes is a degraded
        link (a bad riser or seating) at any time; a lower generation only while the GPU
        is not idle (an idle GPU lowers it to save power, and raises it under load)."""
        h = g.handle
        if (v := self._read(g, found, "nvmlDeviceGetCurrPcieLinkWidth", h)) is not _SKIP:
            st.pcie_width = int(v)
        if (v := self._read(g, found, "nvmlDeviceGetMaxPcieLinkWidth", h)) is not _SKIP:
            st.pcie_width_max = int(v)
        if (v := self._read(g, found, "nvmlDeviceGetCurrPcieLinkGeneration", h)) is not _SKIP:
            st.pcie_gen = int(v)
        if (v := self._read(g, found, "nvmlDeviceGetMaxPcieLinkGeneration", h)) is not _SKIP:
            st.pcie_gen_max = int(v)
        t = pcie_shortfall(st.pcie_width, st.pcie_width_max, st.pcie_gen, st.pcie_gen_max, idle)
        if t is not None:
            found.append(_Finding(t.key, "pcie_link", None, Verdict.DEGRADED, t.reason))

    def _read_clock_events(self, g: _Gpu, found: list[_Finding]) -> Any:
        # ...ClocksEventReasons is the R535+ name; older drivers only have ...ThrottleReasons.
        for fn in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
            if fn not in g.unsupported:
                v = self._read(g, found, fn, g.handle)
                if v is not _SKIP or fn not in g.unsupported:
                    return v
        return _SKIP

    def _read_recovery_action(self, g: _Gpu, found: list[_Finding]) -> int | None:
        fn = "nvmlDeviceGetFieldValues"
        values = self._read(g, found, fn, g.handle, [FIELD_GPU_RECOVERY_ACTION])
        if values is _SKIP:
            return None
        v = values[0]
        rc = int(v.nvmlReturn)
        if rc == 0:
            return int(field_value(v))
        if rc in (NOT_SUPPORTED, FUNCTION_NOT_FOUND, INVALID_ARGUMENT):
            g.unsupported.add(fn)  # driver predates field 230
        elif rc in LOST_CODES:
            self._mark_lost(g, rc, f"{fn}[{FIELD_GPU_RECOVERY_ACTION}]")
            raise _Abort
        else:
            found.append(
                _Finding(
                    f"probe_error:{fn}",
                    "probe_error",
                    rc,
                    Verdict.FAILED,
                    f"probe error: {fn}[{FIELD_GPU_RECOVERY_ACTION}] returned {rc}",
                )
            )
        return None

    def _read(self, g: _Gpu, found: list[_Finding], fn: str, *args: Any, cache_unsupported: bool = True) -> Any:
        """One metric read with the fail-closed rules; returns _SKIP if there is no value."""
        if fn in g.unsupported:
            return _SKIP
        try:
            return self._call(g, fn, *args)
        except CallTimeout as e:
            found.append(_Finding("probe_timeout", "probe_timeout", None, Verdict.FAILED, f"probe timeout: {e}"))
            raise _Abort from None  # the GPU is wedged: do not queue more calls on it
        except _Missing:
            g.unsupported.add(fn)
            return _SKIP
        except Exception as e:
            code = self._code(e)
            if code in (NOT_SUPPORTED, FUNCTION_NOT_FOUND):
                if cache_unsupported:
                    g.unsupported.add(fn)
                return _SKIP
            if code in LOST_CODES:
                self._mark_lost(g, code, fn)
                raise _Abort from None
            found.append(
                _Finding(
                    f"probe_error:{fn}", "probe_error", code, Verdict.FAILED, f"probe error: {fn}: {describe_error(e)}"
                )
            )
            return _SKIP

    # -- NVML calls -------------------------------------------------------------

    def _call(self, g: _Gpu | None, fn_name: str, *args: Any, timeout_s: float | None = None) -> Any:
        """One NVML call under the lock, with a deadline; a GPU with a stuck call fails fast."""
        fn = getattr(self._nvml, fn_name, None)
        if fn is None:
            raise _Missing(fn_name)
        return self._calls.call(
            fn,
            *args,
            key=None if g is None else g.index,
            name=fn_name,
            timeout_s=self._call_timeout_s if timeout_s is None else timeout_s,
        )

    def _quiet_call(self, fn_name: str, *args: Any) -> None:
        try:
            self._call(None, fn_name, *args)
        except Exception as e:
            log.debug("%s failed during stop: %s", fn_name, describe_error(e))

    def _code(self, exc: BaseException) -> int | None:
        if isinstance(exc, self._nvml_error):
            value = getattr(exc, "value", None)
            return value if isinstance(value, int) else None
        return None

    # -- start-up helpers -------------------------------------------------------

    def _enumerate(self) -> None:
        try:
            self.driver_version = as_text(self._call(None, "nvmlSystemGetDriverVersion"))
        except Exception as e:
            log.info("cannot read the NVIDIA driver version: %s", describe_error(e))
        try:
            count = int(self._call(None, "nvmlDeviceGetCount"))
        except Exception as e:
            raise NvmlUnavailable(f"NVML unavailable: nvmlDeviceGetCount failed: {describe_error(e)}") from e
        for i in range(count):
            g = _Gpu(index=i)
            self._gpus.append(g)
            try:
                g.handle = self._call(None, "nvmlDeviceGetHandleByIndex", i)
            except Exception as e:
                code = self._code(e)
                if code in LOST_CODES:
                    self._mark_lost(g, code, "nvmlDeviceGetHandleByIndex")
                else:
                    self._add_sticky(
                        g,
                        _Finding(
                            "no_handle",
                            "probe_error",
                            code,
                            Verdict.FAILED,
                            f"probe error: no NVML handle: {describe_error(e)}",
                        ),
                    )
                continue
            g.addr = handle_key(g.handle)
            if g.addr is not None:
                self._by_addr[g.addr] = g
            g.uuid = as_text(self._info(g, "nvmlDeviceGetUUID", g.handle))
            g.name = as_text(self._info(g, "nvmlDeviceGetName", g.handle))
            pci = self._info(g, "nvmlDeviceGetPciInfo", g.handle)
            if pci is not None:
                g.pci_bus_id = bus_id = as_text(pci.busId)
                try:
                    self._by_bus[pci_bus_key(bus_id or "")] = g
                except ValueError:
                    log.warning("GPU %d: unparsable PCI bus id %r", i, bus_id)

    def _info(self, g: _Gpu, fn: str, *args: Any) -> Any:
        """An identity read: None on any failure (poll reports the GPU's state)."""
        if g.lost:
            return None
        try:
            return self._call(g, fn, *args)
        except Exception as e:
            code = self._code(e)
            if code in LOST_CODES:
                self._mark_lost(g, code, fn)
            return None

    def _register_events(self) -> None:
        try:
            self._event_set = self._call(None, "nvmlEventSetCreate")
        except Exception as e:
            log.warning("NVML events unavailable (%s): relying on polling and the kernel log", describe_error(e))
            return
        registered = 0
        for g in self._gpus:
            if g.lost or g.handle is None:
                continue
            try:
                supported = int(self._call(g, "nvmlDeviceGetSupportedEventTypes", g.handle))
            except Exception as e:
                if self._code(e) in LOST_CODES:
                    self._mark_lost(g, self._code(e), "nvmlDeviceGetSupportedEventTypes")
                    continue
                supported = WATCHED_EVENTS  # unknown: ask for all, registration decides
            mask = WATCHED_EVENTS & supported
            if not mask:
                continue
            try:
                self._call(g, "nvmlDeviceRegisterEvents", g.handle, mask, self._event_set)
                registered += 1
            except Exception as e:
                if self._code(e) in LOST_CODES:
                    self._mark_lost(g, self._code(e), "nvmlDeviceRegisterEvents")
                else:
                    log.warning("GPU %d: cannot register NVML events: %s", g.index, describe_error(e))
        self.events_enabled = registered > 0

    def _scan_nvlinks_safely(self, g: _Gpu) -> None:
        if g.lost or g.handle is None:
            return
        try:
            self._scan_nvlinks(g, [])
        except _Abort:
            pass  # left unscanned; poll rescans and reports the GPU's state

    def _scan_nvlinks(self, g: _Gpu, found: list[_Finding]) -> None:
        """Finds the GPU's NVLinks. Watches them all if any is up at the scan.

        If none is up the GPU is taken to have no NVLink in use (a PCIe card
        without a bridge reports its links inactive), so none is watched.
        On an unexpected error the GPU stays unscanned (the next poll retries)
        and the error is a finding, like any failed read.
        """
        active: list[int] = []
        inactive: list[int] = []
        fn = "nvmlDeviceGetNvLinkState"
        for link in range(int(getattr(self._nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                up = self._call(g, fn, g.handle, link)
            except CallTimeout as e:
                found.append(_Finding("probe_timeout", "probe_timeout", None, Verdict.FAILED, f"probe timeout: {e}"))
                raise _Abort from None
            except _Missing:
                break
            except Exception as e:
                code = self._code(e)
                if code in LOST_CODES:
                    self._mark_lost(g, code, fn)
                    raise _Abort from None
                if code == NOT_SUPPORTED and link > 0:
                    continue  # a hole in the link numbering
                if code in (NOT_SUPPORTED, INVALID_ARGUMENT, FUNCTION_NOT_FOUND):
                    break  # no NVLink, or past the last link
                found.append(
                    _Finding(
                        f"probe_error:{fn}",
                        "probe_error",
                        code,
                        Verdict.FAILED,
                        f"probe error: {fn}({link}): {describe_error(e)}",
                    )
                )
                return
            (active if up else inactive).append(link)
        g.nvlinks = sorted(active + inactive) if active else []
        if inactive and not active:
            log.info("GPU %d: no NVLink up; NVLink not watched", g.index)

    # -- events -------------------------------------------------------------------

    def _event_loop(self) -> None:
        wait_ms = max(1, int(self._event_wait_s * 1000))
        failures = 0
        reported_code: object = _SKIP  # sentinel: nothing reported in this streak
        while not self._stop.is_set():
            try:
                data = self._wait_event(wait_ms)
            except Exception as e:
                code = self._code(e)
                if code == TIMEOUT:
                    failures, reported_code = 0, _SKIP
                    continue
                failures += 1
                if code in LOST_CODES:
                    self._find_lost_gpus()
                elif code != reported_code:  # once per streak and code, not per retry
                    reported_code = code
                    self._emit(
                        [
                            self._event(
                                None,
                                "event_wait_error",
                                code,
                                Verdict.DEGRADED,
                                f"NVML event wait failing ({describe_error(e)}); relying on polling",
                                time.monotonic(),
                                time.time(),
                            )
                        ]
                    )
                self._stop.wait(min(5.0, 0.05 * 2 ** min(failures, 7)))
                continue
            failures, reported_code = 0, _SKIP
            try:
                self._emit(self._handle_event(data))
            except Exception:
                log.exception("error while handling an NVML event")

    def _wait_event(self, wait_ms: int) -> Any:
        # Outside the NVML lock: it blocks for wait_ms by design.
        wait = getattr(self._nvml, "nvmlEventSetWait_v2", None) or self._nvml.nvmlEventSetWait
        return wait(self._event_set, wait_ms)

    def _handle_event(self, data: Any) -> list[HealthEvent]:
        t_mono, t_wall = time.monotonic(), time.time()
        addr = handle_key(data.device)
        g = self._by_addr.get(addr) if addr is not None else None
        etype, edata = int(data.eventType), int(data.eventData)
        events: list[HealthEvent] = []
        if etype & EVENT_XID:
            ev = self._apply_xid(g, edata, "NVML event", t_mono, t_wall)
            if ev is not None:
                events.append(ev)
        if etype & EVENT_DOUBLE_BIT_ECC:
            events.append(
                self._sticky_event(
                    g, "ecc_dbe", None, Verdict.FAILED, "double-bit ECC error (NVML event)", t_mono, t_wall
                )
            )
        if etype & EVENT_GPU_UNAVAILABLE:
            events.append(
                self._sticky_event(
                    g, "gpu_unavailable", None, Verdict.FAILED, "GPU unavailable (NVML event)", t_mono, t_wall
                )
            )
        if etype & EVENT_RECOVERY_ACTION:
            verdict, reason = classify_recovery_action(edata)
            events.append(
                self._sticky_event(g, "recovery_action", edata, verdict, reason + " (NVML event)", t_mono, t_wall)
            )
        return events

    def _sticky_event(
        self, g: _Gpu | None, kind: str, code: int | None, verdict: Verdict, reason: str, t_mono: float, t_wall: float
    ) -> HealthEvent:
        if g is not None and verdict is not Verdict.HEALTHY:
            self._add_sticky(g, _Finding(f"{kind}:{code}", kind, code, verdict, reason))
        return self._event(g.index if g else None, kind, code, verdict, reason, t_mono, t_wall)

    def _apply_xid(self, g: _Gpu | None, code: int, source: str, t_mono: float, t_wall: float) -> HealthEvent | None:
        xc = classify_xid(code, self._overrides)
        verdict, reason = xc.verdict, f"{xc.reason} ({source})"
        if code == XID_RECOVERY_ACTION_CHANGED and g is not None and not xc.overridden:
            try:
                action = self._read_recovery_action(g, []) if not g.lost else None
            except _Abort:
                action = None  # lost or wedged: reported by _mark_lost / the next poll
            if action is not None:
                verdict, why = classify_recovery_action(action)
                reason = f"Xid {code} ({xc.description}): {why} ({source})"
        if g is None:
            return self._event(
                None, "xid", code, verdict, reason, t_mono, t_wall, xid_class=xc.health_class.value, action=xc.action
            )
        with self._state_lock:
            g.last_xid, g.last_xid_wall = code, t_wall
            seen = g.xid_seen_mono.get(code)
            if seen is not None and t_mono - seen < XID_DEDUP_WINDOW_S:
                return None
            g.xid_seen_mono[code] = t_mono  # window from the last report, so repeats resurface
            if verdict is not Verdict.HEALTHY:
                self._add_sticky(g, _Finding(f"xid:{code}", "xid", code, verdict, reason))
        return self._event(
            g.index, "xid", code, verdict, reason, t_mono, t_wall, xid_class=xc.health_class.value, action=xc.action
        )

    def ingest_kmsg_xid(self, xid: KmsgXid) -> HealthEvent | None:
        """Feeds an Xid seen in the kernel log (KmsgFollower's on_xid).

        Maps the PCI bus id to the GPU, classifies, updates its state and emits
        the event, unless NVML reported the same Xid on that GPU just before.
        """
        try:
            g = self._by_bus.get(pci_bus_key(xid.pci_bus_id))
        except ValueError:
            g = None
        ev = self._apply_xid(g, xid.xid, f"kernel log: {xid.message}".rstrip(": "), time.monotonic(), time.time())
        if ev is not None:
            self._emit([ev])
        return ev

    def _find_lost_gpus(self) -> None:
        """The event wait said a GPU is lost without saying which: ask each."""
        for g in self._gpus:
            if g.lost or g.handle is None:
                continue
            try:
                self._call(g, "nvmlDeviceGetTemperature", g.handle, TEMPERATURE_GPU)
            except Exception as e:
                if self._code(e) in LOST_CODES:
                    self._mark_lost(g, self._code(e), "nvmlDeviceGetTemperature")

    # -- bookkeeping -----------------------------------------------------------------

    def _mark_lost(self, g: _Gpu, code: int | None, fn: str) -> None:
        what = LOST_CODES.get(code or 0, "GPU lost")
        finding = _Finding("gpu_lost", "gpu_lost", code, Verdict.FAILED, f"{what}: {fn} returned {code}")
        if self._add_sticky(g, finding):
            self._emit(
                [self._event(g.index, "gpu_lost", code, Verdict.FAILED, finding.reason, time.monotonic(), time.time())]
            )

    def _add_sticky(self, g: _Gpu, finding: _Finding) -> bool:
        """Records a finding for the probe's life; False if it was already there."""
        with self._state_lock:
            if finding.key in g.sticky:
                return False
            g.sticky[finding.key] = finding
            g.reported.add(finding.key)
            return True

    def _event(
        self,
        gpu_index: int | None,
        kind: str,
        code: int | None,
        verdict: Verdict,
        reason: str,
        t_mono: float,
        t_wall: float,
        **extra: Any,
    ) -> HealthEvent:
        return HealthEvent(
            gpu_index=gpu_index,
            kind=kind,
            code=code,
            verdict=verdict,
            reason=reason,
            t_mono=t_mono,
            t_wall=t_wall,
            **extra,
        )

    def _emit(self, events: list[HealthEvent]) -> None:
        for ev in events:
            self.recent_events.append(ev)
            if self._on_event is None:
                continue
            try:
                self._on_event(ev)
            except Exception:
                log.exception("on_event callback failed for %s", ev)
