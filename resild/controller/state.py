"""The controller's shared mutable state, and the configuration it runs under.

One object that the message handlers (handlers.py) and the effects of decisions
(effects.py) both read and write, so that neither reaches into the Controller: the
view of the job, who to reach (the broadcaster's identities), the journal, the event
log, the backend, the first epoch's layout, the committed step and the verdict.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from resild.controller.backend import Backend
from resild.controller.broadcast import Broadcaster
from resild.controller.budget import Budget, Limits
from resild.controller.journal import Journal
from resild.controller.policy import SUSPECT_WINDOW_S, AbuseLimits, Decision
from resild.controller.stragglers import Paces
from resild.controller.view import ClusterView, JobResult
from resild.events.log import EventLog
from resild.membership import Membership
from resild.rendezvous import Rendezvous
from resild.wire.channel import Channel
from resild.wire.keys import KeyDir
from resild.wire.settings import Derived, JobSettings


@dataclass
class ControllerConfig:
    bind: str = "tcp://127.0.0.1:0"
    # The job's timeouts (one owner: resil-run builds it once; see resild.wire.settings).
    # The policy's view of them, and what the job's size changes, are derived in Controller.
    settings: JobSettings = field(default_factory=JobSettings)
    tick_s: float = 0.02
    idle_tick_s: float = 0.1  # between checks of a steady job (policy.tick_interval_s)
    max_batch: int = 1000  # messages handled before the timeout checks run again
    resync_s: float = 1.0  # a node still reporting an old epoch this long after a send gets its view again
    shutdown_timeout_s: float = 600.0  # at success: time for workers to finish (final save)
    wait_nodes_gone_s: float = 0.0  # > 0: at the end, wait until no node process has heartbeat for this long
    term: int = 1  # rises with every leader (standby controllers); nodes follow the highest
    leader_index: int = 0  # this controller's place in the endpoint list node processes hold
    # Per node per second (budget.py): peers' events are for the log, not worth the job; a
    # node's progress is what the hang check reads, so its budget is far above any real rate
    # (a node process aggregates its ranks' commits every 100 ms; direct workers per step).
    event_budget: Limits = Limits(messages=200, bytes=256 << 10)
    progress_budget: Limits = Limits(messages=5000, bytes=16 << 20)
    # A node that stays over those budgets is fenced (policy.abuse_verdict).
    abuse: AbuseLimits = AbuseLimits()
    suspect_window_s: float = SUSPECT_WINDOW_S  # a second strike within this drains a suspect node
    # The controller's own errors (errors.py): a tick failing on every round this long makes
    # it stop, without a SHUTDOWN (policy.give_up_verdict); 0: never.
    tick_error_limit_s: float = 60.0
    job_id: str = ""  # names the job to `resil-run --join` (join.json); "": no node joins
    readmit: bool = False  # a node fenced on suspicion comes back as a spare (readmission.py; --readmit)
    spare_target: int = 0  # ask the queue for cold spares while the pool is below this (refill.py)
    refill_interval_s: float = 2.0  # how often the pool is checked against the target


def lease_terms(cfg: ControllerConfig, derived: Derived) -> tuple[int, int, float, float]:
    """What a lease says: term, leader index, interval, the nodes' wait."""
    return cfg.term, cfg.leader_index, derived.lease_interval_s, derived.lease_timeout_s


@dataclass(eq=False)
class ControllerState:
    view: ClusterView
    bc: Broadcaster  # epochs and leases out; who to reach (node and direct-worker identities)
    events: EventLog
    journal: Journal
    backend: Backend
    initial: Membership  # the first epoch's layout (start-up replacements applied)
    unregistered: int  # active workers yet to register: O(1) start check
    max_step: int = 0
    node_steps: dict[str, int] = field(default_factory=dict)  # the newest step each node's reports claim
    result: JobResult | None = None
    awaiting_full_strength: int | None = None  # epoch whose first commit we wait for
    # (step, t, node) each time the job's step advanced
    commit_times: list[tuple[int, float, str | None]] = field(default_factory=list)
    budget: Budget = field(default_factory=lambda: Budget({}))  # per-node EVENT/PROGRESS limits (handlers)
    rendezvous: Rendezvous = field(default_factory=Rendezvous)  # the epochs' group-formation keys
    deferred: int = 0  # decisions not carried out: the replicated journal did not commit them
    deferred_decisions: list[Decision] = field(default_factory=list)  # tried again at each tick
    abusive: dict[str, float] = field(default_factory=dict)  # node -> when it was last named abusive
    keys: KeyDir | None = None  # the job's key directory: a joining node's key is minted here
    joined_sources: set[str] = field(default_factory=set)  # where admitted nodes came from ("slurm:<id>")
    unvouched: str | None = None  # why the job's state cannot be vouched for (a worker said: state_unvouched)
    paces: Paces = field(default_factory=lambda: Paces(50))  # per node, its latest steps' paces (stragglers)
    steps_planned: int = 0  # the steps the training loop was asked for (job.steps(total)), as ranks say
    stragglers_said: set[tuple[int, str]] = field(default_factory=set)  # (epoch, node): decided once an epoch
    fatals: dict[str, tuple[float, str]] = field(default_factory=dict)  # node -> (when, what) it said FATAL
    window_judged: bool = False  # --straggler-window against the job's length: said (once) if too long
    epoch_announced_s: float = 0.0  # when the current epoch was announced
    recoveries_s: list[float] = field(default_factory=list)  # announced -> full strength, each recovery

    @property
    def dropped(self) -> dict[str, int]:
        """Messages dropped over each node's budget."""
        return self.budget.dropped

    @property
    def ch(self) -> Channel:
        return self.bc.ch

    @property
    def node_ident(self) -> dict[str, bytes]:
        return self.bc.node_ident

    @property
    def worker_ident(self) -> dict[tuple[str, int], bytes]:
        return self.bc.worker_ident
