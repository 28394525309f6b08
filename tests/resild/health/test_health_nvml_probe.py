"""NvmlProbe through the real nvidia-ml-py binding and the fake libnvidia-ml.so.1.

Each test runs probe_scenario.py in a child process (pynvml loads the library
once per process) with LD_LIBRARY_PATH and FAKE_NVML_CONTROL set.
"""

from __future__ import annotations

import ctypes.util
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)

FAST = {"event_wait_s": 0.05, "call_timeout_s": 1.0}


def start(**kwargs) -> dict:
    return {"op": "start", "kwargs": {**FAST, **kwargs}}


POLL = {"op": "poll"}


def append(*lines: str) -> dict:
    return {"op": "append", "lines": list(lines)}


def wait(count: int, kind: str | None = None, timeout_s: float = 5.0) -> dict:
    return {"op": "wait_events", "count": count, "kind": kind, "timeout_s": timeout_s}


def by_gpu(poll_result: dict) -> dict[int, dict]:
    return {s["index"]: s for s in poll_result["statuses"]}


def test_healthy_node_baseline(run_scenario) -> None:
    out = run_scenario(["gpus 8", "set 3 temp 71", "set 3 power_w 350"], [start(), POLL])
    assert out["results"][0]["gpu_count"] == 8
    assert out["results"][0]["events_enabled"] is True
    poll = out["results"][1]
    gpus = by_gpu(poll)
    assert poll["node"] == {"verdict": "healthy", "reasons": []}
    assert len({g["uuid"] for g in gpus.values()}) == 8
    g3 = gpus[3]
    assert g3["verdict"] == "healthy" and g3["reasons"] == []
    assert (g3["temperature_c"], g3["power_w"]) == (71, 350.0)
    assert g3["ecc_uncorrected"] == 0 and g3["recovery_action"] == 0
    assert g3["remap"] == {"corrected_rows": 0, "uncorrected_rows": 0, "pending": False, "failure": False}
    assert g3["nvlink_down"] == [] and g3["throttle_reasons"] == []
    assert g3["pci_bus_id"] == "00000000:40:00.0"
    assert out["events"] == []


def test_xid_events_through_the_binding(run_scenario) -> None:
    out = run_scenario(
        ["gpus 4"],
        [
            start(xid_overrides={"43": "failed"}),
            append("event 2 xid 79"),
            wait(1, "xid"),
            append("event 0 xid 13", "event 0 xid 43", "event 1 xid 12345"),
            wait(4, "xid"),
            POLL,
        ],
    )
    appended_wall = out["results"][1]["t_wall"]
    xids = [e for e in out["events"] if e["kind"] == "xid"]
    assert [(e["gpu_index"], e["code"]) for e in xids] == [(2, 79), (0, 13), (0, 43), (1, 12345)]
    x79 = xids[0]
    assert x79["verdict"] == "failed" and x79["xid_class"] == "failed"
    assert "GPU has fallen off the bus" in x79["reason"]
    assert x79["action"] == "reboot node"
    assert x79["t_wall"] - appended_wall < 2.0  # delivered at once, not at the next poll
    assert (xids[1]["verdict"], xids[1]["xid_class"]) == ("healthy", "app_error")
    assert (xids[2]["verdict"], xids[2]["xid_class"]) == ("failed", "failed")  # overridden
    assert "overridden" in xids[2]["reason"]
    assert xids[3]["verdict"] == "degraded" and "unknown" in xids[3]["reason"]
    gpus = by_gpu(out["results"][-1])
    assert gpus[2]["verdict"] == "failed" and gpus[2]["last_xid"] == 79
    assert gpus[2]["last_xid_wall"] == pytest.approx(x79["t_wall"])
    assert gpus[0]["verdict"] == "failed" and gpus[0]["last_xid"] == 43
    assert gpus[1]["verdict"] == "degraded"
    assert gpus[3]["verdict"] == "healthy"
    assert out["results"][-1]["node"]["verdict"] == "failed"
    # polls do not repeat what the event thread already reported
    assert len(out["events"]) == 4


def test_ecc_dbe_unavailable_and_recovery_events(run_scenario) -> None:
    out = run_scenario(
        ["gpus 4"],
        [
            start(),
            append(
                "event 1 dbe", "event 2 unavailable", "event 3 recovery 2", "set 0 recovery_action 4", "event 0 xid 154"
            ),
            wait(4),
            POLL,
        ],
    )
    events = {(e["gpu_index"], e["kind"]): e for e in out["events"]}
    assert events[(1, "ecc_dbe")]["verdict"] == "failed"
    assert events[(2, "gpu_unavailable")]["verdict"] == "failed"
    rec = events[(3, "recovery_action")]
    assert (rec["verdict"], rec["code"]) == ("failed", 2) and "node reboot" in rec["reason"]
    x154 = events[(0, "xid")]  # Xid 154: the class comes from field 230
    assert x154["verdict"] == "degraded" and "drain and reset" in x154["reason"]
    gpus = by_gpu(out["results"][-1])
    assert [gpus[i]["verdict"] for i in range(4)] == ["degraded", "failed", "failed", "failed"]
    assert gpus[0]["recovery_action"] == 4


def test_events_before_registration_are_lost_but_counters_catch_them(run_scenario) -> None:
    out = run_scenario(["gpus 2", "event 0 dbe", "set 0 ecc_uncorrected 2"], [start(), POLL])
    assert [e["kind"] for e in out["events"]] == ["ecc_uncorrected"]  # from the baseline read
    assert by_gpu(out["results"][-1])[0]["verdict"] == "degraded"


def test_uncorrected_ecc_counter(run_scenario) -> None:
    out = run_scenario(
        ["gpus 2"],
        [
            start(),
            append("set 1 ecc_uncorrected 3"),
            POLL,
            POLL,
            append("set 1 ecc_uncorrected 5"),
            POLL,
        ],
    )
    g1 = by_gpu(out["results"][2])[1]
    assert g1["verdict"] == "degraded" and g1["ecc_uncorrected"] == 3
    assert "3 uncorrected ECC errors" in g1["reasons"][0]
    ecc = [e for e in out["events"] if e["kind"] == "ecc_uncorrected"]
    assert [(e["gpu_index"], e["code"]) for e in ecc] == [(1, 3), (1, 5)]  # once per increase
    assert by_gpu(out["results"][-1])[0]["verdict"] == "healthy"


def test_row_remapping(run_scenario) -> None:
    out = run_scenario(
        ["gpus 3"],
        [
            start(),
            append("set 0 remap_failure 1", "set 1 remap_pending 1", "set 1 remap_uncorrected 2"),
            POLL,
        ],
    )
    gpus = by_gpu(out["results"][-1])
    assert gpus[0]["verdict"] == "failed" and gpus[0]["remap"]["failure"] is True
    assert "row remapping failed" in gpus[0]["reasons"][0]
    assert gpus[1]["verdict"] == "degraded" and gpus[1]["remap"]["pending"] is True
    assert gpus[1]["remap"]["uncorrected_rows"] == 2
    assert gpus[2]["verdict"] == "healthy"
    assert {(e["gpu_index"], e["kind"]) for e in out["events"]} == {(0, "remap_failure"), (1, "remap_pending")}


def test_nvlink_down(run_scenario) -> None:
    out = run_scenario(
        [
            "gpus 4",
            "set 0 nvlink 5 0",  # one link of 18 down at start: a fault
            "set 1 nvlinks 0",  # no NVLink at all
            "set 2 nvlinks 2",
            "set 2 nvlink 0 0",
            "set 2 nvlink 1 0",  # none up: not in use
        ],
        [start(), POLL, append("set 3 nvlink 7 0", "set 3 nvlink 17 0"), POLL],
    )
    first, last = by_gpu(out["results"][1]), by_gpu(out["results"][-1])
    assert first[0]["verdict"] == "failed" and first[0]["nvlink_down"] == [5]
    assert first[1]["verdict"] == first[2]["verdict"] == first[3]["verdict"] == "healthy"
    assert last[3]["verdict"] == "failed" and last[3]["nvlink_down"] == [7, 17]
    assert last[3]["reasons"] == ["NVLink 7 down", "NVLink 17 down"]
    downs = [(e["gpu_index"], e["code"]) for e in out["events"] if e["kind"] == "nvlink_down"]
    assert downs == [(0, 5), (3, 7), (3, 17)]


def test_gpu_lost_and_reset_required(run_scenario) -> None:
    out = run_scenario(
        ["gpus 3"],
        [
            start(),
            append("set 1 lost 1", "set 2 reset_required 1"),
            POLL,
            POLL,
        ],
    )
    gpus = by_gpu(out["results"][-1])
    assert gpus[0]["verdict"] == "healthy"
    assert gpus[1]["verdict"] == "failed" and "GPU is lost" in gpus[1]["reasons"][0]
    assert gpus[2]["verdict"] == "failed" and "reset" in gpus[2]["reasons"][0]
    lost = [(e["gpu_index"], e["code"]) for e in out["events"] if e["kind"] == "gpu_lost"]
    assert lost == [(1, 15), (2, 16)]  # once, not once per poll
    assert all(e["verdict"] == "failed" for e in out["events"])


def test_gpu_lost_before_start(run_scenario) -> None:
    out = run_scenario(["gpus 2", "set 0 lost 1"], [start(), POLL])
    assert out["results"][0]["gpu_count"] == 2
    gpus = by_gpu(out["results"][-1])
    assert gpus[0]["verdict"] == "failed" and gpus[0]["uuid"] is None
    assert gpus[1]["verdict"] == "healthy"
    assert [(e["gpu_index"], e["kind"]) for e in out["events"]] == [(0, "gpu_lost")]


def test_hanging_call_fails_closed(run_scenario) -> None:
    out = run_scenario(
        ["gpus 3", "set 2 hang_ms 5000"],
        [
            start(call_timeout_s=0.3),
            append("set 1 hang_ms 5000"),
            POLL,
            POLL,
        ],
    )
    # Bounded by the call timeout, not the 5 s hang (generous margins for a loaded CI box).
    assert out["results"][0]["elapsed_s"] < 3.0  # a GPU hung at start does not block start
    first, second = out["results"][2], out["results"][3]
    assert first["elapsed_s"] < 3.0
    assert second["elapsed_s"] < 1.5  # a GPU still hung is not called again: no new wait
    for poll in (first, second):
        gpus = by_gpu(poll)
        assert gpus[0]["verdict"] == "healthy" and gpus[0]["temperature_c"] == 40
        for i in (1, 2):
            assert gpus[i]["verdict"] == "failed"
            assert gpus[i]["reasons"][0].startswith("probe timeout")
    timeouts = [e["gpu_index"] for e in out["events"] if e["kind"] == "probe_timeout"]
    assert timeouts == [2, 1]


def test_raising_and_unsupported_calls(run_scenario) -> None:
    out = run_scenario(
        [
            "gpus 4",
            "fail 0 nvmlDeviceGetTemperature 999",  # unexpected error: fail closed
            "fail 1 nvmlDeviceGetPowerUsage 3",  # NotSupported: metric skipped
            "fail 2 nvmlDeviceGetRemappedRows 13",  # FunctionNotFound: metric skipped
            "fail 3 nvmlDeviceGetNvLinkState 999",  # an error while finding the NVLinks
        ],
        [start(), POLL],
    )
    gpus = by_gpu(out["results"][-1])
    assert gpus[0]["verdict"] == "failed"
    assert gpus[0]["reasons"] == ["probe error: nvmlDeviceGetTemperature: NVMLError_Unknown: Unknown Error"]
    assert gpus[0]["temperature_c"] is None and gpus[0]["power_w"] == 100.0  # others still read
    assert gpus[1]["verdict"] == "healthy" and gpus[1]["power_w"] is None
    assert gpus[2]["verdict"] == "healthy" and gpus[2]["remap"] is None
    assert gpus[3]["verdict"] == "failed"
    assert gpus[3]["reasons"][0].startswith("probe error: nvmlDeviceGetNvLinkState(0)")
    assert [(e["gpu_index"], e["kind"]) for e in out["events"]] == [(0, "probe_error"), (3, "probe_error")]


def test_old_driver_missing_functions(run_scenario, old_fake_nvml_dir: Path) -> None:
    out = run_scenario(
        ["gpus 2", "set 0 clocks_event 0x48", "set 1 clocks_event 0x1"],
        [start(clock_event_hold_s=0), POLL],
        lib_dir=old_fake_nvml_dir,
    )
    gpus = by_gpu(out["results"][-1])
    for g in gpus.values():
        assert g["remap"] is None and g["recovery_action"] is None  # functions absent: skipped
        assert g["temperature_c"] == 40
    # clock reasons via the older ...ClocksThrottleReasons
    assert gpus[0]["throttle_reasons"] == ["hw_slowdown", "hw_thermal_slowdown"]
    assert gpus[0]["verdict"] == "degraded"
    assert gpus[1]["throttle_reasons"] == ["gpu_idle"] and gpus[1]["verdict"] == "healthy"


def test_pcie_replays_and_clock_events(run_scenario) -> None:
    out = run_scenario(
        ["gpus 2", "set 0 pcie_replays 100"],
        [
            start(clock_event_hold_s=0),
            append("set 0 pcie_replays 103", "set 1 pcie_replays 9", "set 1 clocks_event 0x80"),
            POLL,
        ],
    )
    gpus = by_gpu(out["results"][-1])
    assert gpus[0]["verdict"] == "healthy" and gpus[0]["pcie_replays"] == 103  # +3: fine
    assert gpus[1]["verdict"] == "degraded"
    assert gpus[1]["throttle_reasons"] == ["hw_power_brake_slowdown"]
    assert any("9 PCIe replays" in r for r in gpus[1]["reasons"])


def test_clock_slowdowns_degrade_a_gpu_only_once_held_over_time(run_scenario) -> None:
    """GPU 0 brakes at every poll: degraded once `clock_event_hold_s` of history says so, not at
    the first read. GPU 1 brakes at one poll of four: normal, never degraded."""
    out = run_scenario(
        ["gpus 2", "set 0 clocks_event 0x80", "set 1 clocks_event 0x80"],
        [
            start(clock_event_hold_s=1.0),
            POLL,
            append("set 1 clocks_event 0x0"),
            {"op": "sleep", "s": 0.4},
            POLL,
            {"op": "sleep", "s": 0.4},
            POLL,
            {"op": "sleep", "s": 0.4},
            POLL,
        ],
    )
    first, last = by_gpu(out["results"][1]), by_gpu(out["results"][-1])
    assert first[0]["verdict"] == "healthy" and first[0]["throttle_reasons"] == ["hw_power_brake_slowdown"]
    assert last[0]["verdict"] == "degraded"
    assert last[0]["reasons"] == ["clocks slowed for most of the last 1 s: hw_power_brake_slowdown"]
    assert last[1]["verdict"] == "healthy", last[1]
    assert [(e["gpu_index"], e["kind"]) for e in out["events"]] == [(0, "clock_event")]


def test_a_pcie_link_below_its_maximum_is_degraded_and_a_lower_generation_only_under_load(run_scenario) -> None:
    out = run_scenario(
        [
            "gpus 4",
            "set 0 pcie_width 8",
            "set 1 pcie_gen 3",
            "set 2 pcie_gen 1",
            "set 2 clocks_event 0x1",  # idle: a lower generation saves power
            "set 3 pcie_width 8",
            "set 3 pcie_width_max 8",  # an x8 slot: at its maximum
        ],
        [start(), POLL],
    )
    gpus = by_gpu(out["results"][-1])
    assert (gpus[0]["pcie_width"], gpus[0]["pcie_width_max"], gpus[0]["pcie_gen"], gpus[0]["pcie_gen_max"]) == (
        8,
        16,
        5,
        5,
    )
    assert gpus[0]["verdict"] == "degraded" and gpus[0]["reasons"] == ["PCIe link degraded: x8 of x16 lanes"]
    assert gpus[1]["verdict"] == "degraded" and gpus[1]["reasons"] == ["PCIe link degraded: gen 3 of 5"]
    assert gpus[2]["verdict"] == "healthy" and gpus[2]["pcie_gen"] == 1
    assert gpus[3]["verdict"] == "healthy"


def test_kmsg_xid_ingest_and_dedup(run_scenario) -> None:
    line = "3,1,1,-;NVRM: Xid (PCI:0000:40:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    out = run_scenario(
        ["gpus 4"],
        [
            start(),
            {"op": "kmsg", "line": line},
            append("event 3 xid 79"),
            {"op": "sleep", "s": 0.3},
            {"op": "kmsg", "line": line.replace("0000:40:00", "0000:99:00")},
            POLL,
        ],
    )
    ev = out["results"][1]["event"]
    assert (ev["gpu_index"], ev["code"], ev["verdict"]) == (3, 79, "failed")  # bus 0x40 = GPU 3
    assert "kernel log" in ev["reason"]
    xids = [(e["gpu_index"], e["code"]) for e in out["events"] if e["kind"] == "xid"]
    assert xids == [(3, 79), (None, 79)]  # NVML's copy deduplicated; unknown bus: node-level
    assert by_gpu(out["results"][-1])[3]["verdict"] == "failed"


def test_driver_not_loaded(run_scenario) -> None:
    out = run_scenario(["init_error 9"], [start()])
    res = out["results"][0]
    assert res["error"] == "NvmlUnavailable"
    assert "nvmlInit failed" in res["message"] and "Driver Not Loaded" in res["message"]


@pytest.mark.skipif(ctypes.util.find_library("nvidia-ml") is not None, reason="a real libnvidia-ml is installed")
def test_no_nvml_library(run_scenario, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    out = run_scenario([], [start()], lib_dir=empty)
    res = out["results"][0]
    assert res["error"] == "NvmlUnavailable"
    assert "Library Not Found" in res["message"] and "libnvidia-ml.so.1" in res["message"]


def test_event_wait_errors(run_scenario) -> None:
    # The wait reports "GPU is lost" without naming it: the probe asks each GPU
    # at once. An unexpected wait error is reported once; the thread goes on.
    out = run_scenario(
        ["gpus 3"],
        [
            start(),
            append("set 1 lost 1", "event 0 wait_error 15"),
            wait(1, "gpu_lost"),
            append("event 0 wait_error 999", "event 2 xid 48"),
            wait(1, "xid"),
        ],
    )
    kinds = [(e["gpu_index"], e["kind"], e["code"]) for e in out["events"]]
    assert kinds == [(1, "gpu_lost", 15), (None, "event_wait_error", 999), (2, "xid", 48)]
    assert out["events"][1]["verdict"] == "degraded"
