"""Ranks that issue different collectives: named in one line instead of a backend abort.

Every collective a script issues on the job's groups (the world group and the mesh
groups; resild's own host-memory groups are not counted) is described by its kind of
group, op, dtype and element count (`Desc`). Two uses:

- The digest. Each step's descriptions are folded into a running digest, and the commit
  vote carries it as sums and sums of squares (`vote_terms`): every rank has the same
  digest exactly when W * sum(d^2) == (sum d)^2 (`agree`), in the vote's one all-reduce.
  Ranks that disagree arm the check for the next step.
- The check. Armed, each collective is preceded by an all-gather of every rank's
  description over the world group, so ranks meet at every collective in lock-step and
  the first differing one is seen before the backend pairs mismatched buffers (gloo
  aborts the process with `op.preamble.length <= op.nbytes`; NCCL hangs). `judge`
  decides, the same on every rank from the same rows: the ranks that ran from the start
  agree and a rank whose process joined later (a spare, `fresh`) differs: a program
  error, and the job stops with one line (`RESILD_CHECK_COLLECTIVES=1`: any difference
  stops it); ranks that ran from the start differ among themselves: the script's groups
  issue different collectives by design, and the check and the digest stay off.

The check is armed for the first step after every recovery (the first step a spare
runs) and after a digest disagreement; `RESILD_CHECK_COLLECTIVES=1` keeps it on (a
debug mode: an all-gather more per collective).
"""

from __future__ import annotations

import logging
import re
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("resild.collectives")

# Ops whose element count may differ between ranks by design (uneven splits, roots).
UNSIZED = frozenset({"alltoall", "all_to_all_single", "gather", "scatter"})
OPS = (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "all_gather_single",
    "all_gather_single_coalesced",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "alltoall",
    "gather",
    "scatter",
    "barrier",
)
_DTYPES = (None, *sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str))
MAX_DIGEST_WORLD = 40_000  # above it the digest's squares could overflow int64: no digest


def group_kind(label: str) -> str:
    """A group's kind, the same on every rank: `resild-shard-3` -> `shard`, `world~2` -> `world`."""
    base = label.split("~", 1)[0]
    base = re.sub(r"-\d+$", "", base)
    return base.removeprefix("resild-")


def _kind_code(kind: str) -> int:
    return zlib.crc32(kind.encode()) & 0x7FFFFFFF


def _flat(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _flat(y)]
    return []


@dataclass(frozen=True)
class Desc:
    """One collective as every rank of a symmetric program issues it."""

    kind: int  # _kind_code(group_kind(label))
    op: int  # index into OPS (-1: one torch added since)
    dtype: int  # index into _DTYPES (0: no tensor)
    numel: int  # -1: not compared (UNSIZED ops)

    @classmethod
    def of(cls, op: str, ins: Any, label: str) -> Desc:
        ts = _flat(ins)
        dtype = _DTYPES.index(ts[0].dtype) if ts else 0
        numel = -1 if op in UNSIZED else sum(t.numel() for t in ts)
        return cls(_kind_code(group_kind(label)), OPS.index(op) if op in OPS else -1, dtype, numel)

    def row(self, fresh: bool) -> list[int]:
        return [self.kind, self.op, self.dtype, self.numel, int(fresh)]

    @classmethod
    def from_row(cls, row: Sequence[int]) -> tuple[Desc, bool]:
        return cls(int(row[0]), int(row[1]), int(row[2]), int(row[3])), bool(row[4])

    def text(self, kinds: dict[int, str]) -> str:
        dtype = _DTYPES[self.dtype] if 0 <= self.dtype < len(_DTYPES) else None
        what = "no tensor" if dtype is None else f"{str(dtype).removeprefix('torch.')}"
        if self.numel >= 0 and dtype is not None:
            what += f", {self.numel} element{'s' if self.numel != 1 else ''}"
        op = OPS[self.op] if 0 <= self.op < len(OPS) else f"op {self.op}"
        return f"{op}({what}) on the {kinds.get(self.kind, f'#{self.kind}')} group"


def digest(d: int, desc: Desc) -> int:
    """The running digest of a step's collectives, `desc` folded in (32 bits)."""
    return zlib.crc32(f"{desc.kind},{desc.op},{desc.dtype},{desc.numel};".encode(), d)


def vote_terms(count: int, d: int, world_size: int) -> list[int]:
    """What a rank adds to the commit vote: per lane (the count, the digest's two 16-bit
    halves) the value and its square. Zeros where the squares could overflow."""
    if world_size > MAX_DIGEST_WORLD:
        return [0] * 6
    lanes = [min(count, 1 << 15), d & 0xFFFF, d >> 16]
    return [x for v in lanes for x in (v, v * v)]


def agree(sums: Sequence[int], world_size: int) -> bool:
    """Every rank voted the same terms: per lane, W * sum(v^2) == (sum v)^2 (Cauchy-Schwarz:
    equal only when all values are equal). Pure."""
    return all(world_size * sums[i + 1] == sums[i] * sums[i] for i in range(0, len(sums), 2))


def _ranks(rs: Sequence[int]) -> str:
    """0,1,2,5 -> '0-2, 5'."""
    out: list[str] = []
    start = prev = None
    for r in sorted(rs):
        if prev is not None and r == prev + 1:
            prev = r
            continue
        if start is not None:
            out.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = r
    if start is not None:
        out.append(str(start) if start == prev else f"{start}-{prev}")
    return ", ".join(out)


@dataclass(frozen=True)
class Verdict:
    """`stop`: a program error, `line` says it; else `asymmetric`: ranks that ran from
    the start differ by design (the check goes off); neither: every rank agrees."""

    stop: bool = False
    asymmetric: bool = False
    line: str = ""


def judge(
    rows: Sequence[Sequence[int]], strict: bool, step: int, index: int, kinds: dict[int, str], why: str
) -> Verdict:
    """Every rank's description of its next collective (`rows[r]`: Desc.row), the same on
    every rank. Pure."""
    parsed = [Desc.from_row(r) for r in rows]
    descs = [d for d, _ in parsed]
    if len(set(descs)) <= 1:
        return Verdict()
    fresh = [r for r, (_, f) in enumerate(parsed) if f]
    original = [r for r, (_, f) in enumerate(parsed) if not f]
    usual = {descs[r] for r in original}
    if len(usual) == 1 and fresh:
        want = usual.pop()
        odd = [r for r in fresh if descs[r] != want]
        who = f"rank {_ranks(odd)} (a process that joined after the job began)"
        got, others = descs[odd[0]], original
    elif strict:
        want, _ = Counter(descs).most_common(1)[0]
        odd = [r for r, d in enumerate(descs) if d != want]
        who = f"rank {_ranks(odd)}"
        got, others = descs[odd[0]], [r for r, d in enumerate(descs) if d == want]
    else:
        return Verdict(asymmetric=True)
    line = (
        f"collective mismatch in step {step} ({why}), collective #{index + 1} of the step: {who} issued "
        f"{got.text(kinds)} while rank {_ranks(others)} issued {want.text(kinds)}. The script issues different "
        "collectives on these ranks: a program error, not a fault, so the job stops here instead of replacing "
        "healthy nodes (RESILD_CHECK_COLLECTIVES=1 checks every step)"
    )
    return Verdict(stop=True, line=line)


Exchange = Callable[[list[int]], list[list[int]] | None]  # this rank's row -> every rank's, or None (epoch failed)


class CollectiveCheck:
    """One rank's ledger of the step's collectives, and the check when armed (see module doc).
    `exchange` all-gathers a row over the world group; `stop(line)` stops the job (never returns)."""

    def __init__(
        self, world_size: int, fresh: bool, step: Callable[[], int], stop: Callable[[str], Any], always: bool = False
    ) -> None:
        self.world_size, self.fresh, self._step, self._stop = world_size, fresh, step, stop
        self.always = always  # RESILD_CHECK_COLLECTIVES=1: check every collective, any difference stops
        self.exchange: Exchange | None = None
        self.kinds: dict[int, str] = {}
        self.armed = always
        self.why = "RESILD_CHECK_COLLECTIVES=1" if always else ""
        self.symmetric = True  # False once ranks that ran from the start were seen to differ by design
        self.count = 0
        self.digest = 0
        self._inside = False

    def name_group(self, label: str) -> None:
        kind = group_kind(label)
        self.kinds[_kind_code(kind)] = kind

    def arm(self, why: str) -> None:
        """Check every collective until the next vote completes (a recovery just ended)."""
        if self.symmetric:
            self.armed, self.why = True, why
        self.count, self.digest = 0, 0

    def before(self, op: str, ins: Any, label: str) -> None:
        """A collective on a checked group is about to be issued."""
        if self._inside:  # the check's own all-gather
            return
        desc = Desc.of(op, ins, label)
        index = self.count
        self.count += 1
        self.digest = digest(self.digest, desc)
        if not self.armed or self.exchange is None:
            return
        self._inside = True
        try:
            rows = self.exchange(desc.row(self.fresh))
        finally:
            self._inside = False
        if rows is None:  # the epoch failed meanwhile: the recovery takes over
            return
        v = judge(rows, self.always, self._step(), index, self.kinds, self.why)
        if v.stop:
            self._stop(v.line)
        elif v.asymmetric:
            self._by_design()

    def _by_design(self) -> None:
        self.symmetric = False
        self.armed = False
        log.info("resild: this job's groups issue different collectives by design: collective checks are off")

    def vote_terms(self) -> list[int]:
        return vote_terms(self.count, self.digest, self.world_size)

    def voted(self, sums: Sequence[int]) -> None:
        """The commit vote completed with `sums` (every rank's vote_terms, summed): the
        step's ledger starts over; ranks that disagreed check the next step."""
        ok = agree(sums, self.world_size)
        self.armed = self.always
        self.count, self.digest = 0, 0
        if not ok and self.symmetric:
            log.warning("resild: ranks issued different collectives in the last step: checking the next one")
            self.arm("after ranks disagreed on the last step's collectives")
