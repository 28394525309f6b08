"""Pure parts of the controller."""

from __future__ import annotations

import pytest

from resild.controller.effects import median_step_s


def test_median_step_counts_one_nodes_consecutive_steps_only() -> None:
    # Two nodes report every 5 steps, 16 ms a step, node B 4 ms behind node A: the job's step
    # advances alternately from A's and B's reports (s from A, s+1 from B 4 ms later).
    pts = []
    for k in range(10):
        base = 5 * k
        pts.append((base + 1, 0.080 * k, "a"))  # A reports step base+1
        pts.append((base + 2, 0.080 * k + 0.004, "b"))  # B reports base+2, 4 ms later
        pts.append((base + 3, 0.080 * k + 0.020, "b"))  # B's next step, 16 ms after its last
    assert median_step_s(pts) == pytest.approx(0.016)
    assert median_step_s([(1, 0.0, "a"), (2, 0.004, "b")]) is None  # no same-node pair: unknown
    assert median_step_s([]) is None
    # one or two pairs by chance (a flushed commit, then a coalesced report 0.1 s later) say nothing
    assert median_step_s([(39, 0.0, "a"), (40, 0.1, "a"), (48, 0.2, "a"), (49, 0.3, "a")]) is None


def test_what_the_job_size_stretches_is_said(caplog: pytest.LogCaptureFixture) -> None:
    """At 2,000 nodes the heartbeat budget stretches the node-loss timeout to 4 s: a warning
    says so (it used to happen silently), and the policy uses the stretched value."""
    import zmq

    from resild.controller.loop import Controller, ControllerConfig
    from resild.events.log import EventLog
    from resild.wire.settings import JobSettings

    ctx = zmq.Context()
    nodes = [f"n{i}" for i in range(2000)]
    try:
        with caplog.at_level("WARNING", logger="resild.controller"):
            big = Controller(ControllerConfig(), nodes[:-2], nodes[-2:], 1, None, EventLog(None), ctx=ctx)
        big.server.close()
        assert "2000 nodes" in caplog.text and "lost after 4.0s of silence (--heartbeat-timeout 2)" in caplog.text
        assert big.policy.heartbeat_timeout_s == 4.0
        caplog.clear()
        with caplog.at_level("WARNING", logger="resild.controller"):
            small = Controller(ControllerConfig(), ["a"], ["b"], 1, None, EventLog(None), ctx=ctx)
        small.server.close()
        assert caplog.text == ""
        assert small.policy.heartbeat_timeout_s == JobSettings().heartbeat_timeout_s
    finally:
        ctx.destroy(linger=0)
