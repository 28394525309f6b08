from __future__ import annotations

from pathlib import Path

import pytest

from resild.health.config import Config
from resild.health.model import Verdict
from resild.health.probes import ProbeRunner, build_probes
from resild_infiniband import InfinibandProbe, make_probe


def fake_sysfs(root: Path, ports: dict[str, str]) -> Path:
    for port, state in ports.items():
        dev, num = port.split("/")
        d = root / dev / "ports" / num
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
    return root


def test_all_active_is_healthy(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"mlx5_0/1": "4: ACTIVE", "mlx5_1/1": "4: ACTIVE"})
    res = InfinibandProbe(root).check()
    assert res.verdict is Verdict.HEALTHY
    assert res.details["ports"] == {"mlx5_0/1": "ACTIVE", "mlx5_1/1": "ACTIVE"}


@pytest.mark.parametrize(
    "state, verdict",
    [("2: INIT", Verdict.DEGRADED), ("3: ARMED", Verdict.DEGRADED), ("1: DOWN", Verdict.FAILED), ("", Verdict.FAILED)],
)
def test_port_not_active(tmp_path: Path, state: str, verdict: Verdict) -> None:
    root = fake_sysfs(tmp_path, {"mlx5_0/1": "4: ACTIVE", "mlx5_1/1": state})
    res = InfinibandProbe(root).check()
    assert res.verdict is verdict
    assert res.reasons and "mlx5_1/1" in res.reasons[0]


def test_missing_ports_fail_when_expected(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"mlx5_0/1": "4: ACTIVE"})
    res = make_probe({"root": str(root), "expected_ports": 2}).check()
    assert res.verdict is Verdict.FAILED and "only 1 of 2" in res.reasons[0]
    assert make_probe({"root": str(tmp_path / "none")}).check().verdict is Verdict.HEALTHY


def test_ignore_and_bad_options(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"mlx5_0/1": "1: DOWN"})
    assert make_probe({"root": str(root), "ignore": ["mlx5_0/1"]}).check().verdict is Verdict.HEALTHY
    with pytest.raises(ValueError, match="unknown infiniband option"):
        make_probe({"rooot": "/x"})


def test_loaded_through_entry_point(tmp_path: Path) -> None:
    root = fake_sysfs(tmp_path, {"mlx5_0/1": "1: DOWN"})
    cfg = Config(probes=["infiniband"], probe_options={"infiniband": {"root": str(root)}})
    [probe] = build_probes(cfg)
    assert ProbeRunner(probe, 2.0).run().result.verdict is Verdict.FAILED
    # A plug-in that cannot be built fails closed instead of vanishing.
    cfg = Config(probes=["infiniband"], probe_options={"infiniband": {"bogus": 1}})
    [broken] = build_probes(cfg)
    out = ProbeRunner(broken, 2.0).run()
    assert out.result.verdict is Verdict.FAILED and "unknown infiniband option" in out.result.reasons[0]
