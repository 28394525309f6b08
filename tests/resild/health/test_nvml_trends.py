"""The NVML reads judged over time or against the maximum, with an injected clock (the
probe's own tests drive the same paths through the NVML stand-in and real pynvml)."""

from __future__ import annotations

from resild.health.nvml_trends import ClockHold, ReplayRate, pcie_shortfall

HW_SLOWDOWN, THERMAL, SW_POWER_CAP, IDLE = 0x8, 0x40, 0x4, 0x1


def test_a_slowdown_held_for_most_of_the_window_degrades_and_a_brief_one_does_not() -> None:
    held, brief = ClockHold(30.0), ClockHold(30.0)
    found_held = found_brief = None
    for i in range(40):  # a poll a second
        t = float(i)
        found_held = held.read(t, THERMAL if i % 3 else HW_SLOWDOWN)  # always some slowdown
        found_brief = brief.read(t, HW_SLOWDOWN if i % 4 == 0 else 0)  # a quarter of the polls
        if i < 30:
            assert found_held is None  # not 30 s of history yet
    assert found_held is not None and found_held.key == "clock_event:hw_slowdown,hw_thermal_slowdown"
    assert found_held.reason == "clocks slowed for most of the last 30 s: hw_slowdown, hw_thermal_slowdown"
    assert found_brief is None


def test_power_capping_and_idle_are_normal_and_hold_zero_judges_the_first_read() -> None:
    normal = ClockHold(0.0)
    assert normal.read(0.0, SW_POWER_CAP | IDLE) is None
    first = ClockHold(0.0).read(0.0, THERMAL)
    assert first is not None and first.reason == "clocks slowed: hw_thermal_slowdown"


def test_replays_over_the_window_and_a_counter_reset() -> None:
    r = ReplayRate(window_s=60.0, most=8)
    assert r.read(0.0, 100) is None
    assert r.read(30.0, 108) is None  # 8 in the window: not more than 8
    hit = r.read(40.0, 109)
    assert hit is not None and hit.code == 9 and hit.reason == "9 PCIe replays in the last 60 s (more than 8)"
    assert r.read(200.0, 115) is None  # the old reads left the window
    assert r.read(201.0, 3) is None  # a lower read: the counter was reset, not 112 fewer replays


def test_the_pcie_link_against_its_maximum() -> None:
    lanes = pcie_shortfall(8, 16, 5, 5, idle=False)
    assert lanes is not None and lanes.reason == "PCIe link degraded: x8 of x16 lanes"
    assert pcie_shortfall(16, 16, 1, 5, idle=True) is None  # an idle GPU lowers its generation
    gen = pcie_shortfall(16, 16, 3, 5, idle=False)
    assert gen is not None and gen.key == "pcie_link:gen 3 of 5"
    assert pcie_shortfall(None, 16, None, 5, idle=False) is None  # unread: nothing said
    assert pcie_shortfall(16, 0, 4, 0, idle=False) is None
