"""Per-node budgets for the messages a node's key holder can send at will (EVENT, PROGRESS).

A node's key lets its holder send anything as that node; 300 one-megabyte EVENTs once kept
the controller writing events while the leases went unsent. Each node gets, per interval,
a number of messages and of bytes per type; over it, the message is dropped and counted,
with one log line per node per interval. Pure bookkeeping on the caller's clock (`now`).

The drops are kept per node too, as `Overage`s (one per interval of `interval_s`, aligned
on the clock, all kinds together; the last `keep`): what `policy.abuse_verdict` judges a
node by. A node that stays over its budget is fenced (handlers.py), not just dropped.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

log = logging.getLogger("resild.controller")


@dataclass(frozen=True)
class Limits:
    messages: int  # per node per interval
    bytes: int  # per node per interval (an estimate of the message's size)


@dataclass(frozen=True)
class Overage:
    """One interval in which some of a node's messages were dropped over its budget."""

    start_s: float  # the interval's start (aligned: a multiple of the budget's interval_s)
    messages: int  # dropped in it
    bytes: int  # their estimated size


@dataclass
class _Window:
    start: float
    messages: int = 0
    bytes: int = 0
    dropped: int = 0


class Budget:
    def __init__(self, limits: dict[str, Limits], interval_s: float = 1.0, keep: int = 64) -> None:
        self.limits, self.interval_s, self.keep = limits, interval_s, keep
        self._windows: dict[tuple[str, str], _Window] = {}
        self.dropped: dict[str, int] = {}  # node -> messages dropped over its budget, all kinds
        self.overages: dict[str, deque[Overage]] = {}  # node -> its last `keep` intervals with drops

    def admit(self, node: str, kind: str, size: int, now: float) -> bool:
        """Whether `node`'s message of `kind` (of about `size` bytes) fits its budget now."""
        lim = self.limits.get(kind)
        if lim is None:
            return True
        key = (node, kind)
        w = self._windows.get(key)
        if w is None or now - w.start >= self.interval_s:
            if w is not None and w.dropped:
                log.warning("%s: %d %s messages over its budget dropped in the last interval", node, w.dropped, kind)
            w = self._windows[key] = _Window(now)
        if w.messages + 1 > lim.messages or w.bytes + size > lim.bytes:
            if not w.dropped:  # one line per node per interval, however large the flood
                log.warning(
                    "%s is over its %s budget (%d messages, %d bytes per %gs): dropping",
                    node,
                    kind,
                    lim.messages,
                    lim.bytes,
                    self.interval_s,
                )
            w.dropped += 1
            self.dropped[node] = self.dropped.get(node, 0) + 1
            self._over(node, size, now)
            return False
        w.messages += 1
        w.bytes += size
        return True

    def _over(self, node: str, size: int, now: float) -> None:
        start = now - now % self.interval_s
        q = self.overages.get(node)
        if q is None:
            q = self.overages[node] = deque(maxlen=self.keep)
        if q and q[-1].start_s == start:
            q[-1] = Overage(start, q[-1].messages + 1, q[-1].bytes + size)
        else:
            q.append(Overage(start, 1, size))
