"""The job's timeouts and intervals: one validated, frozen object with one owner.

`resil-run` builds a `JobSettings` once, from its command line; construction checks
every value and the nesting rules, so a bad combination is one line naming both flags
and nothing starts. The same object travels as a typed body (`to_dict`/`from_dict`,
validated again on arrival) to the controller and its standby replicas, and the values
derived from it are computed here, once:

- `for_nodes(n)`: what the job's size changes (the controller's heartbeat budget):
  the node processes' heartbeat interval, the effective node-loss timeout, how often
  leases go out and how long a node process waits for one. The controller sends the
  node processes these numbers (WELCOME, LEASE); they never derive them again.
- `worker_timeouts()`: the workers' collective, report and notice timeouts (WELCOME).
- `worker_redundancy()`: the workers' snapshot, checkpoint and verification settings, and
  whether they time their own pace (`pace`: not under `--stragglers off`) (WELCOME).

The nesting, checked at construction:
    heartbeat interval < --heartbeat-timeout < --controller-timeout < collective timeout
(a node must miss several heartbeats before it is lost; the controller must be able to
declare a node lost before the nodes give up on the controller; and a collective must not
time out before the controller has had its say).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# How each setting is named where a user sets it: errors speak the user's language.
FLAGS = {
    "heartbeat_interval_s": "the heartbeat interval",
    "heartbeat_timeout_s": "--heartbeat-timeout",
    "controller_timeout_s": "--controller-timeout",
    "hang_timeout_s": "--hang-timeout",
    "start_timeout_s": "--start-timeout",
    "join_timeout_s": "the join timeout",
    "start_heartbeat_timeout_s": "the start-up heartbeat timeout",
    "heartbeat_budget_per_s": "the heartbeat budget",
    "snapshot_copies": "--snapshot-copies",
    "snapshot_every": "--snapshot-every",
    "snapshot_budget": "--snapshot-budget",
    "fingerprint_every": "--fingerprint-every",
    "verify_every": "--verify-every",
    "straggler_threshold": "--straggler-threshold",
    "straggler_window": "--straggler-window",
    "stragglers": "--stragglers",
    "checkpoint_every": "--checkpoint-every",
    "checkpoint_dir": "--checkpoint-dir",
    "min_replicas": "--min-replicas",
}
COUNTS = (
    "snapshot_copies",
    "snapshot_every",
    "fingerprint_every",
    "checkpoint_every",
    "min_replicas",
    "verify_every",
    "straggler_window",
)
COUNT_MIN = {
    "snapshot_copies": -1,
    "snapshot_every": 0,  # 0: auto
    "fingerprint_every": 0,
    "checkpoint_every": 0,
    "min_replicas": 0,
    "verify_every": 0,
    "straggler_window": 2,
}
# Upper bounds a user would accept: past them a value is a typo (1e14 s), and some overflow
# where they are used (a step count in an int64 vote, a socket timeout in ms).
COUNT_MAX = 10**6  # steps between snapshots, compares, checkpoints, verifications; a window; replicas
MAX_DURATION_S = {
    "heartbeat_interval_s": 60.0,
    "heartbeat_timeout_s": 3600.0,
    "controller_timeout_s": 3600.0,
    "hang_timeout_s": 86400.0,  # a day: a step, or a collective, that long is a hang anywhere
    "start_timeout_s": 86400.0,
    "join_timeout_s": 86400.0,
    "start_heartbeat_timeout_s": 3600.0,
    "heartbeat_budget_per_s": 10.0**6,  # heartbeats a second, not seconds
}
TEXTS = ("checkpoint_dir", "stragglers")
STRAGGLER_ACTIONS = ("replace", "report", "off")  # --stragglers
MAX_STRAGGLER_THRESHOLD = 10.0  # 10 = 11x the others' pace: past that a node is hung, not slow
MAX_COPIES = 8
DEFAULT_SNAPSHOT_BUDGET = 0.02  # --snapshot-every auto: snapshots may cost 2% of a step
MAX_SNAPSHOT_BUDGET = 0.5


def _share(v: Any) -> bool:
    """A share of a step a user could mean: a number in (0, MAX_SNAPSHOT_BUDGET]."""
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v <= MAX_SNAPSHOT_BUDGET


def _budget(v: Any) -> float:
    return float(v) if _share(v) else DEFAULT_SNAPSHOT_BUDGET


AUTO_COPIES = -1  # --snapshot-copies auto: 1 where no rank has a replica (FSDP2, TP), else 0
MIN_COLLECTIVE_TIMEOUT_S = 60.0  # gloo/NCCL collectives never time out sooner than this
# `resild check --qualify` (probes and the GPU self-test, a torch import) bounds how long a
# joining or re-admitted node takes before it registers: the node process gives up after it,
# and the controller drops an admitted spare that never registered.
QUALIFY_TIMEOUT_S = 300.0


class SettingsError(ValueError):
    """A bad setting or combination; the message is one line a user can act on."""


def _num(v: float) -> str:
    return f"{v:g}"


@dataclass(frozen=True)
class Derived:
    """Values that follow from the settings and the job's size, computed once."""

    heartbeat_interval_s: float  # node processes heartbeat this often
    heartbeat_timeout_s: float  # a node silent this long is lost (never less than 4 intervals)
    lease_interval_s: float  # the controller leases every node this often (0: no leases)
    lease_timeout_s: float  # a node process that hears no controller this long stops (0: never)


@dataclass(frozen=True)
class WorkerTimeouts:
    """The workers' share of the settings, sent in WELCOME (JobSettings.worker_timeouts)."""

    collective_timeout_s: float  # a collective must not time out before the controller could declare a hang
    wait_report_s: float  # a rank blocked this long in a collective says so (the hang detector names it)
    notice_timeout_s: float  # after a failed collective, how long a rank waits for the controller's notice

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)

    @classmethod
    def from_welcome(cls, body: Mapping[str, Any]) -> WorkerTimeouts:
        """What a WELCOME says; a value it lacks (a worker run alone, no controller) or one that
        is not a positive number is JobSettings' default: the defaults have one owner."""
        default = JobSettings().worker_timeouts()
        out: dict[str, float] = {}
        for f in dataclasses.fields(cls):
            v = body.get(f.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
                out[f.name] = float(v)
            else:
                out[f.name] = getattr(default, f.name)
        return cls(**out)


@dataclass(frozen=True)
class WorkerRedundancy:
    """The workers' snapshot settings, sent in WELCOME beside the timeouts, and whether
    they time their own pace for the straggler policy."""

    snapshot_copies: int = AUTO_COPIES
    snapshot_every: int = 1
    fingerprint_every: int = 0
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    # > 0: with no spare left the job drops a failed node's replicas and trains on while at
    # least this many remain (a data-parallel job's every rank is a replica); grows back.
    min_replicas: int = 0
    verify_every: int = 0  # every K steps each rank computes its step twice and compares (0: never)
    pace: bool = True  # each rank times its own steps (launcher.worker.pace); --stragglers off: not
    snapshot_budget: float = DEFAULT_SNAPSHOT_BUDGET  # snapshot_every 0 (auto): the share of a step they may cost

    def to_dict(self) -> dict[str, int | str | bool]:
        return dataclasses.asdict(self)

    @classmethod
    def from_welcome(cls, body: Mapping[str, Any]) -> WorkerRedundancy:
        def count(name: str, lo: int, default: int) -> int:
            v = body.get(name)
            return v if isinstance(v, int) and not isinstance(v, bool) and v >= lo else default

        return cls(
            count("snapshot_copies", AUTO_COPIES, AUTO_COPIES),
            count("snapshot_every", 0, 1),
            count("fingerprint_every", 0, 0),
            d if isinstance(d := body.get("checkpoint_dir"), str) else "",
            count("checkpoint_every", 0, 0),
            count("min_replicas", 0, 0),
            count("verify_every", 0, 0),
            p if isinstance(p := body.get("pace"), bool) else True,
            _budget(body.get("snapshot_budget")),
        )

    def copies(self, has_replicas: bool, nodes: int) -> int:
        """auto: one copy where no replica covers a rank and another node exists to hold it."""
        if self.snapshot_copies == AUTO_COPIES:
            return 0 if has_replicas or nodes < 2 else 1
        return self.snapshot_copies


@dataclass(frozen=True)
class JobSettings:
    heartbeat_interval_s: float = 0.25
    heartbeat_timeout_s: float = 2.0
    controller_timeout_s: float = 5.0  # 0: no leases (node processes never give up on the controller)
    hang_timeout_s: float = 10.0
    start_timeout_s: float = 300.0  # every active node's workers registered within this, or the job fails
    join_timeout_s: float = 300.0  # a spare building its model and receiving state is not hung
    # Before the first epoch a node is lost only after this much silence: start-up (imports,
    # thousands of registrations) can starve a node process for seconds, and nothing waits on it.
    start_heartbeat_timeout_s: float = 15.0
    # Heartbeats the controller accepts per second, all nodes together: past that, node
    # processes heartbeat less often (N / budget seconds) and the node-loss timeout grows to
    # 4 such intervals. 2,000 nodes at 0.25 s would be 8,000 messages/s before any progress.
    # Crashed nodes are still found at once (process exit); only a frozen node takes longer. 0: off.
    heartbeat_budget_per_s: float = 2000.0
    # Peer-memory snapshots: copies of each rank's state on other nodes (-1: auto), every N commits.
    snapshot_copies: int = AUTO_COPIES
    snapshot_every: int = 1  # 0: auto, the cadence that keeps their measured cost under snapshot_budget of a step
    snapshot_budget: float = DEFAULT_SNAPSHOT_BUDGET
    # Replicas compare state fingerprints every N commits (0: never): silent divergence is caught.
    fingerprint_every: int = 0
    # resild's own disk checkpoints (torch.distributed.checkpoint): "" none; every N commits.
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    # Shrink instead of stop when no spare is left, down to this many replicas (0: never shrink).
    min_replicas: int = 0
    # Every K steps each rank computes its step twice and compares its gradients (0: never):
    # wrong gradients, which replicas' fingerprints cannot see, are caught before the commit.
    verify_every: int = 0
    # Stragglers (resild.controller.stragglers): a node whose pace over its last N steps is
    # more than this share above the others' is one; replaced by a spare when that pays,
    # or only reported, or not watched.
    straggler_threshold: float = 0.25
    straggler_window: int = 50
    stragglers: str = "replace"

    def __post_init__(self) -> None:
        if not isinstance(self.checkpoint_dir, str) or len(self.checkpoint_dir) > 4096:
            raise SettingsError(f"--checkpoint-dir must be a path, not {self.checkpoint_dir!r}")
        for name in COUNTS:
            v = getattr(self, name)
            bad_copies = name == "snapshot_copies" and isinstance(v, int) and v > MAX_COPIES
            if isinstance(v, bool) or not isinstance(v, int) or bad_copies or v < COUNT_MIN[name]:
                lo = {"snapshot_copies": "0 (or -1: auto)", "snapshot_every": "1 (or 0: auto)"}.get(
                    name, str(COUNT_MIN[name])
                )
                raise SettingsError(f"{FLAGS[name]} must be a whole number >= {lo}, not {v!r}")
            if v > COUNT_MAX:
                raise SettingsError(f"{FLAGS[name]} must be at most {COUNT_MAX:,}, not {v:,}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise SettingsError("--checkpoint-every needs --checkpoint-dir (where resild writes its checkpoints)")
        if self.stragglers not in STRAGGLER_ACTIONS:
            raise SettingsError(f"--stragglers must be one of {', '.join(STRAGGLER_ACTIONS)}, not {self.stragglers!r}")
        t = self.straggler_threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= MAX_STRAGGLER_THRESHOLD:
            raise SettingsError(
                f"--straggler-threshold must be a share above the others' pace in (0, {MAX_STRAGGLER_THRESHOLD:g}] "
                f"(0.25: 25% slower), not {t!r}"
            )
        object.__setattr__(self, "straggler_threshold", float(t))
        if not _share(self.snapshot_budget):
            raise SettingsError(
                f"--snapshot-budget must be a share of a step in (0, {MAX_SNAPSHOT_BUDGET:g}] (0.02: 2%), "
                f"not {self.snapshot_budget!r}"
            )
        object.__setattr__(self, "snapshot_budget", float(self.snapshot_budget))
        if self.snapshot_budget != DEFAULT_SNAPSHOT_BUDGET and self.snapshot_every != 0:
            raise SettingsError(
                f"--snapshot-budget applies to --snapshot-every auto, not --snapshot-every {self.snapshot_every}"
            )
        for f in dataclasses.fields(self):
            if f.name in COUNTS or f.name in TEXTS or f.name in ("straggler_threshold", "snapshot_budget"):
                continue
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise SettingsError(f"{FLAGS[f.name]} must be a number of seconds, not {v!r}")
            if not math.isfinite(v) or v < 0:
                raise SettingsError(f"{FLAGS[f.name]} must be a finite number >= 0, not {v!r}")
            if v > (most := MAX_DURATION_S[f.name]):
                unit = "" if f.name == "heartbeat_budget_per_s" else " seconds"
                raise SettingsError(f"{FLAGS[f.name]} must be at most {_num(most)}{unit}, not {_num(v)}")
            object.__setattr__(self, f.name, float(v))
        for name in ("heartbeat_interval_s", "heartbeat_timeout_s", "hang_timeout_s", "start_timeout_s"):
            if getattr(self, name) <= 0:
                raise SettingsError(f"{FLAGS[name]} must be > 0, not {_num(getattr(self, name))}")
        self._nest("heartbeat_interval_s", "heartbeat_timeout_s")
        if self.controller_timeout_s > 0:
            self._nest("heartbeat_timeout_s", "controller_timeout_s")
            ctl_s, coll_s = self.controller_timeout_s, self.collective_timeout_s
            if ctl_s >= coll_s:
                raise SettingsError(
                    f"--controller-timeout {_num(ctl_s)} must be less than the collective timeout ({_num(coll_s)}s: "
                    f"the larger of {_num(MIN_COLLECTIVE_TIMEOUT_S)}s and 3 x --hang-timeout "
                    f"{_num(self.hang_timeout_s)}): raise --hang-timeout or lower --controller-timeout"
                )

    def _nest(self, lo: str, hi: str) -> None:
        lo_v, hi_v = getattr(self, lo), getattr(self, hi)
        if lo_v >= hi_v:
            raise SettingsError(
                f"{FLAGS[lo]} {_num(lo_v)} must be less than {FLAGS[hi]} {_num(hi_v)} "
                f"(they nest: heartbeat interval < --heartbeat-timeout < --controller-timeout < collective timeout)"
            )

    # ---- derived values ------------------------------------------------------------
    @property
    def collective_timeout_s(self) -> float:
        """A collective must not time out before the controller could have declared a hang."""
        return max(MIN_COLLECTIVE_TIMEOUT_S, 3 * self.hang_timeout_s)

    def worker_timeouts(self) -> WorkerTimeouts:
        """What the workers are told (WELCOME): the collective timeout, how often a blocked
        rank reports, and how long a rank waits for the controller's notice after a failed
        collective (past the collective timeout and the controller's own detection)."""
        return WorkerTimeouts(
            collective_timeout_s=self.collective_timeout_s,
            wait_report_s=min(1.0, self.hang_timeout_s / 4),
            notice_timeout_s=self.collective_timeout_s + 2 * self.hang_timeout_s + self.heartbeat_timeout_s + 60.0,
        )

    def worker_redundancy(self) -> WorkerRedundancy:
        return WorkerRedundancy(
            self.snapshot_copies,
            self.snapshot_every,
            self.fingerprint_every,
            self.checkpoint_dir,
            self.checkpoint_every,
            self.min_replicas,
            self.verify_every,
            self.stragglers != "off",
            self.snapshot_budget,
        )

    def for_nodes(self, n_nodes: int) -> Derived:
        """The heartbeat budget at this job size: nodes heartbeat every N / budget seconds
        at least, a node is lost after 4 such intervals at least, leases go out every
        quarter of --controller-timeout but no more often than 4 heartbeat intervals, and a
        node waits 3 lease intervals (never less than --controller-timeout)."""
        floor_s = n_nodes / self.heartbeat_budget_per_s if self.heartbeat_budget_per_s > 0 else 0.0
        interval_s = max(self.heartbeat_interval_s, floor_s)
        timeout_s = max(self.heartbeat_timeout_s, 4 * floor_s)
        if self.controller_timeout_s <= 0:
            return Derived(interval_s, timeout_s, 0.0, 0.0)
        lease_s = max(self.controller_timeout_s / 4, 4 * floor_s)
        return Derived(interval_s, timeout_s, lease_s, max(self.controller_timeout_s, 3 * lease_s))

    # ---- the typed body ------------------------------------------------------------
    def to_dict(self) -> dict[str, float | str]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Any) -> JobSettings:
        """Validated like a command line: an unknown or missing key is an error, not a default."""
        if not isinstance(d, dict):
            raise SettingsError(f"job settings must be an object, not {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise SettingsError(f"unknown job setting(s): {', '.join(map(str, unknown))}")
        missing = sorted(names - set(d))
        if missing:
            raise SettingsError(f"job settings lack: {', '.join(missing)}")
        return cls(**d)
