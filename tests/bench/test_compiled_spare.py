"""bench/compiled_spare.py's pure parts: the worker command (an inductor cache per node)
and the summary (medians per path, ratios to the eager yardstick, the 2x target)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.compiled_spare import summarize, worker

pytestmark = pytest.mark.timeout(30)


def test_each_node_compiles_into_a_cache_of_its_own() -> None:
    cmd = worker("prepared", Path("/tmp/x"))
    assert cmd[:2] == ["sh", "-c"] and 'TORCHINDUCTOR_CACHE_DIR="$0/$RESILD_NODE"' in cmd[2]
    assert cmd[3] == "/tmp/x" and cmd[-1] == "--compile"
    assert "--compile" not in worker("eager", Path("/tmp/x"))


def test_the_summary_is_medians_and_ratios_to_eager() -> None:
    runs = [
        {"path": "eager", "recovery_s": 0.2, "graphs": 0},
        {"path": "eager", "recovery_s": 0.4, "graphs": 0},
        {"path": "prepared", "recovery_s": 0.5, "graphs": 0},
        {"path": "unprepared", "recovery_s": 6.0, "graphs": 3},
        {"path": "unprepared", "recovery_s": None, "graphs": None},  # a run that measured nothing
    ]
    s = summarize(runs)
    assert s["eager_recovery_s"] == 0.3 and s["prepared_ratio"] == round(0.5 / 0.3, 3)
    assert s["unprepared_ratio"] == 20.0 and s["unprepared_graphs"] == 3
    assert s["target_met"] is True
    assert summarize([{"path": "prepared", "recovery_s": 1.0, "graphs": 0}])["target_met"] is None
