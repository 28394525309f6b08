from __future__ import annotations

import pytest

from resild.health.config import Config
from resild.health.model import Verdict
from resild.health.probes import build_probes
from resild_diskspace import DiskspaceProbe, Thresholds, Usage, judge_usage, make_probe

GiB = 2**30


@pytest.mark.parametrize(
    "free, verdict",
    [
        (50, Verdict.HEALTHY),
        (10, Verdict.HEALTHY),
        (9, Verdict.DEGRADED),
        (2, Verdict.DEGRADED),
        (1, Verdict.FAILED),
        (0, Verdict.FAILED),
    ],
)
def test_fraction_thresholds(free: int, verdict: Verdict) -> None:
    v, why = judge_usage(Usage("/dev/shm", 100 * GiB, free * GiB), Thresholds())
    assert v is verdict
    assert (why is None) == (verdict is Verdict.HEALTHY)


def test_byte_thresholds() -> None:
    t = Thresholds(degraded_free_bytes=20 * GiB, failed_free_bytes=5 * GiB)
    assert judge_usage(Usage("/", 1000 * GiB, 500 * GiB), t)[0] is Verdict.HEALTHY
    assert judge_usage(Usage("/", 1000 * GiB, 19 * GiB), t)[0] is Verdict.FAILED  # 1.9% < 2%
    t2 = Thresholds(0.0, 0.0, 20 * GiB, 5 * GiB)
    assert judge_usage(Usage("/", 1000 * GiB, 19 * GiB), t2)[0] is Verdict.DEGRADED
    assert judge_usage(Usage("/", 1000 * GiB, 4 * GiB), t2)[0] is Verdict.FAILED


def test_probe_worst_path_and_unstattable_fails_closed() -> None:
    table = {"/": Usage("/", 100, 50), "/dev/shm": Usage("/dev/shm", 100, 5)}

    def usage(path: str) -> Usage:
        if path not in table:
            raise FileNotFoundError(2, "No such file or directory")
        return table[path]

    res = DiskspaceProbe(["/", "/dev/shm"], Thresholds(), usage).check()
    assert res.verdict is Verdict.DEGRADED and res.reasons[0].startswith("/dev/shm:")
    res = DiskspaceProbe(["/", "/nope"], Thresholds(), usage).check()
    assert res.verdict is Verdict.FAILED and "/nope: cannot stat" in res.reasons[0]


def test_real_statvfs_and_options(tmp_path) -> None:
    probe = make_probe({"paths": [str(tmp_path)], "degraded_free_fraction": 0.0, "failed_free_fraction": 0.0})
    assert probe.check().verdict is Verdict.HEALTHY
    with pytest.raises(ValueError, match="thresholds"):
        make_probe({"degraded_free_fraction": 0.01, "failed_free_fraction": 0.5})
    [p] = build_probes(
        Config(
            probes=["diskspace"], probe_options={"diskspace": {"paths": [str(tmp_path)], "degraded_free_fraction": 0}}
        )
    )
    assert p.name == "diskspace"
