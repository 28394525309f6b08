"""Fault injection specs: `KIND:NODE@STEP[+DELAY_S]`, e.g. `kill:node1@40`, `xid79:node2@120`,
or `KIND:NODE@eN` to fire the moment membership epoch N is announced (a fault during recovery).

Kinds: kill (SIGKILL one worker), exception (a worker raises), hang (SIGSTOP one
worker), nodeloss (SIGKILL the node process and all its workers), xidN (the
node's GPU probe reports Xid N through the fault-injecting NVML stand-in), corrupt
(every peer-memory snapshot copy held on the node is damaged from then on, as bad
memory would: recovery must detect it by checksum and use another copy), diverge
(worker 0 of the node nudges one parameter, as a GPU computing wrong numbers would:
the replicas' fingerprints must catch it), badgrad (worker 0 of the node computes wrong
gradients for one step, which every replica then averages in: --verify-every must catch it),
slow (every worker of the node is slower by PCT% of its step from then on, `slow:NODE@STEP+PCT%`,
50% by default, as a throttled GPU would: the straggler policy must find it).
A fault fires once the job's committed step reaches STEP (plus DELAY_S seconds).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("kill", "exception", "hang", "nodeloss", "corrupt", "diverge", "badgrad", "slow")
_SPEC = re.compile(
    r"(?P<kind>[a-z]{1,16}[0-9]{0,6}):(?P<node>[A-Za-z0-9_.-]{1,128})"
    r"@(?:(?P<step>[0-9]{1,15})|e(?P<epoch>[0-9]{1,15}))"
    r"(?:\+(?:(?P<pct>[0-9]{1,4})%|(?P<delay>[0-9]{1,7}(?:\.[0-9]{1,6})?)))?",
    re.ASCII,
)


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    kind: str
    node: str
    step: int
    delay_s: float = 0.0
    local_rank: int = 0
    epoch: int | None = None  # fire when this epoch is announced instead of at a step
    pct: int = 0  # slow: how much slower each step becomes (% of the step; 0: the worker's 50%)

    @property
    def xid(self) -> int | None:
        return int(self.kind[3:]) if self.kind.startswith("xid") else None

    def __str__(self) -> str:
        at = f"e{self.epoch}" if self.epoch is not None else str(self.step)
        delay = f"{self.delay_s:.6f}".rstrip("0").rstrip(".")  # parse_fault(str(f)) == f
        tail = f"+{self.pct}%" if self.pct else f"+{delay}" if self.delay_s else ""
        return f"{self.kind}:{self.node}@{at}{tail}"


def parse_fault(spec: str) -> Fault:
    m = _SPEC.fullmatch(spec.strip()) if isinstance(spec, str) and len(spec) <= 256 else None
    if not m:
        raise FaultSpecError(
            f"bad fault spec {str(spec)[:80]!r}: expected KIND:NODE@STEP[+DELAY_S], e.g. kill:node1@40 "
            "(slow:NODE@STEP+PCT%: slower by PCT% of a step)"
        )
    kind = m["kind"]
    if kind not in KINDS and not re.fullmatch(r"xid[0-9]{1,6}", kind):
        raise FaultSpecError(
            f"unknown fault kind {kind!r} in {spec!r}: one of {', '.join(KINDS)}, or xidN (e.g. xid79)"
        )
    epoch = int(m["epoch"]) if m["epoch"] is not None else None
    pct = int(m["pct"]) if m["pct"] is not None else 0
    if (pct and kind != "slow") or not 0 <= pct <= 1000:
        raise FaultSpecError(f"bad fault spec {spec!r}: +PCT% is a slow fault's slowdown, 1-1000%")
    return Fault(kind, m["node"], int(m["step"] or 0), float(m["delay"] or 0.0), epoch=epoch, pct=pct)


class Injector:
    """Decides which faults are due; pure apart from remembering what fired."""

    def __init__(self, faults: list[Fault], settle_s: float = 30.0) -> None:
        self.pending = sorted(faults, key=lambda f: (f.step, f.delay_s))
        self._armed_at: dict[Fault, float] = {}
        # A fired fault is unsettled until its recovery's epoch is announced (or settle_s,
        # for a fault nobody detects): the next step fault waits, else two faults meant
        # apart can hit before the first was even seen, and take out both copies of a state.
        self.settle_s = settle_s
        self._unsettled_since: float | None = None

    def fired(self, f: Fault, now: float) -> None:
        """`f` went out. A corrupt fault damages copies, a slow one slows a node, without
        failing anything: no recovery need follow, so it holds nothing back."""
        if f.kind not in ("corrupt", "slow"):
            self._unsettled_since = now

    def settled(self) -> None:
        """A new epoch was announced: the fault (if any) has been detected and handled."""
        self._unsettled_since = None

    def unsettled(self, now: float) -> bool:
        if self._unsettled_since is not None and now - self._unsettled_since >= self.settle_s:
            self._unsettled_since = None
        return self._unsettled_since is not None

    def rearm(self, f: Fault) -> None:
        """A fault whose firing was not journaled: due again at the next check."""
        if f not in self.pending:
            self.pending.append(f)
            self.pending.sort(key=lambda g: (g.step, g.delay_s))

    def due(self, committed_step: int, now: float, epoch: int = 0, busy: bool = False) -> list[Fault]:
        """Faults to fire now. Step faults: not while `busy` (a recovery or a takeover under
        way, or a fired fault not yet detected), and only the earliest step's when several
        are due at once (a controller that was away must not fire a schedule's faults all
        together: they were meant apart)."""
        busy = busy or self.unsettled(now)
        fire = []
        first = min((f.step for f in self.pending if f.epoch is None and committed_step >= f.step), default=None)
        for f in list(self.pending):
            if (f.epoch is not None and epoch >= f.epoch) or (f.epoch is None and not busy and f.step == first):
                t0 = self._armed_at.setdefault(f, now)
                if now - t0 >= f.delay_s:
                    fire.append(f)
                    self.pending.remove(f)
        return fire
