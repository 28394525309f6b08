from __future__ import annotations

import json

import pytest

from resild.health.model import GpuStatus, HealthEvent, RemapStatus, Verdict, worst
from resild.health.verdict import node_verdict

pytestmark = pytest.mark.timeout(30)


def test_worst() -> None:
    assert worst() is Verdict.HEALTHY
    assert worst(Verdict.HEALTHY, Verdict.DEGRADED) is Verdict.DEGRADED
    assert worst(Verdict.FAILED, Verdict.DEGRADED, Verdict.HEALTHY) is Verdict.FAILED


def test_to_dict_is_json() -> None:
    st = GpuStatus(
        index=1,
        uuid="GPU-x",
        verdict=Verdict.DEGRADED,
        reasons=["r"],
        remap=RemapStatus(1, 0, True, False),
        nvlink_down=[3],
    )
    d = json.loads(json.dumps(st.to_dict()))
    assert d["verdict"] == "degraded"
    assert d["remap"] == {"corrected_rows": 1, "uncorrected_rows": 0, "pending": True, "failure": False}
    ev = HealthEvent(gpu_index=None, kind="xid", code=79, verdict=Verdict.FAILED, reason="r", t_mono=1.0, t_wall=2.0)
    assert json.loads(json.dumps(ev.to_dict()))["verdict"] == "failed"


def test_node_verdict() -> None:
    ok = GpuStatus(index=0)
    deg = GpuStatus(index=2, verdict=Verdict.DEGRADED, reasons=["row remap pending"])
    bad = GpuStatus(index=1, verdict=Verdict.FAILED, reasons=["Xid 79", "NVLink 3 down"])
    assert node_verdict([ok]) == (Verdict.HEALTHY, [])
    assert node_verdict([]) == (Verdict.HEALTHY, [])
    verdict, reasons = node_verdict([deg, ok, bad])
    assert verdict is Verdict.FAILED
    assert reasons == ["gpu1: Xid 79", "gpu1: NVLink 3 down", "gpu2: row remap pending"]
    verdict, reasons = node_verdict([ok], expected_gpus=2)
    assert verdict is Verdict.FAILED and "only 1 of 2" in reasons[0]
