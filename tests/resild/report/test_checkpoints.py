"""resild.report.checkpoints: what became of a job's disk checkpoints, from its events."""

from __future__ import annotations

import pytest

from resild.report.checkpoints import CheckpointCounts, checkpoint_counts

pytestmark = pytest.mark.timeout(30)


def test_saves_failures_abandons_deferrals_and_loads_are_counted() -> None:
    events = [
        {"event": "progress", "step": 5},
        {"event": "checkpoint_saved", "step": 10},
        {"event": "checkpoint_failed", "step": 20, "abandoned": True, "error": "StaleEpoch: x"},
        {"event": "checkpoint_deferred", "step": 30},
        {"event": "checkpoint_failed", "step": 40, "abandoned": False, "error": "OSError: full"},
        {"event": "checkpoint_saved", "step": 50},
        {"event": "checkpoint_loaded", "step": 50},
    ]
    c = checkpoint_counts(events)
    assert c == CheckpointCounts(
        saved=2, failed=1, abandoned=1, deferred=1, loaded=1, last_saved_step=50, last_error="OSError: full"
    )
    assert c.line() == (
        "disk checkpoints: 2 saved (newest step 50), 1 failed, 1 abandoned by a recovery, 1 deferred, "
        "1 loaded; last error: OSError: full"
    )


def test_a_job_without_checkpoint_events_has_no_counts() -> None:
    assert checkpoint_counts([{"event": "progress", "step": 5}, {"event": "job_finished"}]) is None
