"""bench/replay_bandwidth.py, tiny: one small state, one run of each path, one JSON line
each, the replayed state bitwise equal to the source's."""

from __future__ import annotations

import json

import pytest

from bench.replay_bandwidth import main


@pytest.mark.timeout(120)
def test_a_tiny_run_prints_one_json_line_per_path_with_the_state_replayed_bitwise(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [
        "--mb",
        "0.1",
        "--layers",
        "2",
        "--sources",
        "1",
        "--runs",
        "1",
        "--paths",
        "direct",
        "direct_prepared",
        "direct_spare",
        "direct_spare_copy",
        "flat",
        "--json",
    ]
    assert main([*argv, "--warm-heap", "--timeout", "60"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    paths = ["loopback", "direct", "direct_prepared", "direct_spare", "direct_spare_copy", "flat"]
    assert [r["path"] for r in rows] == paths
    assert all(r["bitwise_equal"] for r in rows if r["path"] != "loopback")
    assert [r["path"] for r in rows if r.get("prepare_s")] == ["direct_prepared"]  # timed apart
    assert all(r["seconds"] > 0 and r["ratio"] > 0 and r["cpu_s"] > 0 for r in rows)
