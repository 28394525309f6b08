"""What one NVML read cannot say, judged over time or against the device's maximum: pure
functions of the reads and `now` (the probe passes time.monotonic(); tests, any clock).

- `ClockHold`: hardware slowdowns (thermal, power brake, HW slowdown) held in at least
  CLOCK_EVENT_DUTY of the polls over the last hold_s, with that much history (a one-off
  read is an instant, and a brief brake is normal).
- `ReplayRate`: PCIe replays counted over a sliding window (the counter only grows; a
  lower read is a reset).
- `pcie_shortfall`: the link against its maximum (GPU and slot): fewer lanes at any time
  (a bad riser or seating), a lower generation only while the GPU is not idle (an idle
  GPU lowers it to save power and raises it under load).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from resild.health.nvml_codes import (
    CLOCK_EVENT_DUTY,
    CLOCK_EVENT_NAMES,
    DEGRADING_CLOCK_EVENTS,
    PCIE_REPLAY_MAX_PER_WINDOW,
    PCIE_REPLAY_WINDOW_S,
)


@dataclass(frozen=True)
class Trend:
    """A finding: `key` identifies it (reported once), `reason` says it."""

    key: str
    code: int | None
    reason: str


@dataclass
class ClockHold:
    hold_s: float
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (t, degrading bits) per poll
    t0: float | None = None  # the first read

    def read(self, now: float, mask: int) -> Trend | None:
        self.samples.append((now, mask & DEGRADING_CLOCK_EVENTS))
        if self.t0 is None:
            self.t0 = now
        while len(self.samples) > 1 and now - self.samples[0][0] > self.hold_s:
            self.samples.popleft()
        slowed = [bits for _, bits in self.samples if bits]
        if not slowed or now - self.t0 < self.hold_s or len(slowed) < CLOCK_EVENT_DUTY * len(self.samples):
            return None
        seen = 0
        for bits in slowed:
            seen |= bits
        names = [n for bit, n in CLOCK_EVENT_NAMES.items() if seen & bit]
        # no share in the text: it would change the reasons (and re-report them) at every poll
        held = f" for most of the last {self.hold_s:.0f} s" if self.hold_s > 0 else ""
        return Trend("clock_event:" + ",".join(names), seen, f"clocks slowed{held}: " + ", ".join(names))


@dataclass
class ReplayRate:
    window_s: float = PCIE_REPLAY_WINDOW_S
    most: int = PCIE_REPLAY_MAX_PER_WINDOW
    samples: deque[tuple[float, int]] = field(default_factory=deque)  # (t, counter)

    def read(self, now: float, count: int) -> Trend | None:
        if self.samples and count < self.samples[-1][1]:
            self.samples.clear()  # counter reset
        self.samples.append((now, count))
        while len(self.samples) > 1 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()
        rise = count - self.samples[0][1]
        if rise <= self.most:
            return None
        return Trend(
            "pcie_replay", rise, f"{rise} PCIe replays in the last {self.window_s:.0f} s (more than {self.most})"
        )


def pcie_shortfall(
    width: int | None, width_max: int | None, gen: int | None, gen_max: int | None, idle: bool
) -> Trend | None:
    short: list[str] = []
    if width is not None and width_max and 0 < width < width_max:
        short.append(f"x{width} of x{width_max} lanes")
    if not idle and gen is not None and gen_max and 0 < gen < gen_max:
        short.append(f"gen {gen} of {gen_max}")
    if not short:
        return None
    return Trend("pcie_link:" + ",".join(short), None, "PCIe link degraded: " + ", ".join(short))
