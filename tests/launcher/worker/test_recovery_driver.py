"""The recovery loop (launcher.worker.recovery_driver) against fakes of the controller
link, the recovery sequence and the job: which epoch it forms, when it asks the controller,
when it stops, how a resize runs through it, and how the state is agreed and restored.
Real jobs run it end to end in tests/launcher/run/test_recovery.py and test_resize.py."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import pytest

from launcher.worker import recovery_driver
from launcher.worker.old_backends import AbortStuck
from launcher.worker.recovery import Agreement, Reformed
from launcher.worker.recovery_driver import RecoveryDriver
from launcher.worker.resize import Resizer
from launcher.worker.runtime import ResilienceError
from launcher.worker.sources.base import IMPOSSIBLE, Need, Restored, Unavailable
from launcher.worker.stable_group import Interrupts
from launcher.worker.step_state import StepState
from launcher.worker.transport.state_transport import Received
from resild.events.schema import EventName, RestoreSource
from resild.membership import Membership
from resild.wire.exits import FENCED_EXIT
from resild.wire.settings import WorkerTimeouts

pytestmark = pytest.mark.timeout(30)

NOTICE_S = 7.0
M1 = Membership.initial(["n0", "n1", "n2"], 2)  # n0: ranks 0, 1; n1: 2, 3; n2: 4, 5


class Link:
    """The controller link as the loop sees it: the memberships announced and not yet taken."""

    def __init__(self, *announced: Membership) -> None:
        self.queue = list(announced)
        self.epoch = 1
        self.shutdown: dict[str, Any] | None = None
        self.waits: list[float] = []
        self.on_wait: Callable[[], None] = lambda: None  # what arrives while the rank waits

    def newer_epoch(self) -> bool:
        return bool(self.queue) and self.queue[0].epoch > self.epoch

    def take(self) -> Membership | None:
        m = self.queue.pop(0) if self.queue else None
        if m is not None:
            self.epoch = m.epoch
        return m

    def wait(self, pred: Callable[[], bool], timeout_s: float) -> bool:
        self.waits.append(timeout_s)
        self.on_wait()
        return pred()


class Rec:
    """The recovery sequence: what it was asked to do, and each forming's outcome in turn
    (seconds taken, an exception, or a callable run first: what happens meanwhile)."""

    def __init__(self, *outcomes: float | BaseException | Callable[[], Any]) -> None:
        self.outcomes = list(outcomes)
        self.groups: dict[str, Any] = {"world": "world", "snapshots": "snapshots"}
        self.abort_wait_s = 0.25
        self.mac = None
        self.log: list[Any] = []
        self.target = 8
        self.agreed: list[tuple[int, int, tuple[int, ...], int]] = []
        self.forgotten = 0  # joins that dropped what the sources made ready

    def retire(self) -> None:
        self.log.append("retire")

    def form(self, epoch: int, groups: list[Any], meanwhile: Callable[[], None] | None = None) -> float:
        self.log.append(("form", epoch, groups))
        if meanwhile is not None:
            meanwhile()
        out = self.outcomes.pop(0) if self.outcomes else 0.5
        while callable(out):
            out = out()
        if isinstance(out, BaseException):
            raise out
        return out

    def agree(self, rank: int, world: int, row: tuple[int, ...], floor: int = 0) -> Agreement:
        self.agreed.append((rank, world, row, floor))
        steps = [self.target] * world
        return Agreement(self.target, [], 0, steps, [[s, 0, 0] for s in steps])

    def replay_mac(self) -> None:
        return None

    def forget_prepared(self) -> None:
        self.forgotten += 1


class Redundancy:
    def __init__(self, log: list[str], back: int | None = None) -> None:
        self.log, self.back = log, back

    def abandon(self) -> None:
        self.log.append("abandon")

    def formed(self) -> None:
        self.log.append("formed")

    def after_divergence(self, rows: list[list[int]]) -> int | None:
        return self.back

    def after_join(self, target: int) -> None:
        self.log.append(f"after_join({target})")


class Commit:
    def __init__(self) -> None:
        self.log: list[Any] = []

    def before_write(self) -> None:
        self.log.append("before_write")

    def settle(self, ag: Agreement, rank: int) -> None:
        self.log.append(("settle", ag.target, rank))

    def resume(self, got: Received | None) -> None:
        self.log.append(("resume", got))


@dataclass
class Source:
    name: RestoreSource
    outcome: Restored | str  # what it restores, or why it cannot
    needs: list[Need] = field(default_factory=list)

    def restore(self, need: Need, why: str) -> Restored:
        self.needs.append(need)
        if isinstance(self.outcome, str):
            raise Unavailable(self.outcome)
        return self.outcome

    def fresh_start(self) -> Restored | None:
        return None

    def ahead(self) -> None:
        self.needs.append("ahead")  # type: ignore[arg-type]


class Job:
    """The job's side (recovery_driver.Host): its place, its state and the hooks it records."""

    def __init__(self, rank: int = 0, world_size: int = 6, epoch: int = 1, attached: bool = True) -> None:
        self.rank, self.world_size, self.epoch = rank, world_size, epoch
        self.state: Any = object() if attached else None
        self.redundancy: Any = None
        self._protocol: Any = Commit()
        self._sources: list[Any] = [Source(RestoreSource.REPLICA, Restored(8, None, RestoreSource.REPLICA))]
        self.floor = 0
        self.refusal: str | None = None
        self.resizes: list[tuple[int, int]] = []
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.progress: list[tuple[str, dict[str, Any]]] = []
        self.fatal: list[str] = []

    def _floor(self) -> int:
        return self.floor

    def _landing(self) -> None:
        return None

    def _cannot_resize(self) -> str | None:
        return self.refusal

    def _resize(self, rank: int, m: Membership) -> None:
        self.resizes.append((rank, m.epoch))
        self.rank, self.world_size = rank, m.world_size

    def _check_shutdown(self) -> None:
        pass

    def _event(self, name: str, **fields: Any) -> None:
        self.events.append((name, fields))

    def _progress(self, state: str, **extra: Any) -> None:
        self.progress.append((state, extra))

    def _fatal(self, why: str) -> NoReturn:
        self.fatal.append(why)
        raise ResilienceError(why)


class Checks:
    def __init__(self) -> None:
        self.armed: list[str] = []

    def arm(self, why: str) -> None:
        self.armed.append(why)


def driver(
    job: Job, rec: Rec, link: Link | None = None, *, node: str = "n0", resizer: Resizer | None = None
) -> RecoveryDriver:
    return RecoveryDriver(
        job,
        rec,  # type: ignore[arg-type]
        Interrupts(),
        link,  # type: ignore[arg-type]
        WorkerTimeouts(collective_timeout_s=60.0, wait_report_s=10.0, notice_timeout_s=NOTICE_S),
        StepState(step=8, committed_aux={}, last_found_inf=0),
        Checks(),  # type: ignore[arg-type]
        resizer or Resizer(full_world_size=6),
        node,
        0,
        ResilienceError,
    )


def names(job: Job) -> list[str]:
    return [name for name, _ in job.events]


# ---- the loop ---------------------------------------------------------------------------
def test_a_new_epoch_at_the_same_width_retires_the_old_groups_forms_every_group_and_rejoins() -> None:
    log: list[str] = []
    job, rec = Job(), Rec()
    job.redundancy = Redundancy(log)
    d = driver(job, rec, Link(M1.replace("n2", "s0")))
    d.intr.fail("rank 4 is gone")
    d.recover()
    assert job.epoch == 2 and (job.rank, job.world_size) == (0, 6) and job.resizes == []
    assert rec.log == ["retire", ("form", 2, ["world", "snapshots"])]
    assert d.intr.error is None  # the failed epoch's error ends with it
    assert log == ["abandon", "formed", "after_join(8)"]
    assert job.events[0] == (EventName.GROUP_REFORMED, {"seconds": 0.5, "world_size": 6, "abort_wait_s": 0.25})
    assert names(job) == [EventName.GROUP_REFORMED, EventName.RESUMED]


def test_the_sources_make_ready_while_the_groups_form_and_what_they_made_is_dropped_after_the_join() -> None:
    job, rec = Job(), Rec()
    src = job._sources[0]
    rec.outcomes = [lambda: rec.log.append(("forming", list(src.needs))) or 0.5]
    driver(job, rec, Link(M1.replace("n2", "s0"))).recover()
    assert rec.log[:2] == ["retire", ("form", 2, ["world", "snapshots"])]
    assert rec.log[2] == ("forming", ["ahead"])  # made ready before the forming returned
    assert src.needs[1:] == [Need(8, 0, [8] * 6, None)] and rec.forgotten == 1
    joining = Job(attached=False)  # a joining spare holds no state to send
    driver(joining, Rec(), Link(M1.replace("n2", "s0"))).recover()
    assert joining._sources[0].needs == []


def test_a_source_failing_ahead_of_time_leaves_the_recovery_to_its_restore() -> None:
    job, rec = Job(), Rec()

    def broken() -> None:
        raise ValueError("replica map does not partition ranks 0..5")

    job._sources[0].ahead = broken
    driver(job, rec, Link(M1.replace("n2", "s0"))).recover()
    assert job.epoch == 2 and job._sources[0].needs == [Need(8, 0, [8] * 6, None)]


def test_a_rank_other_than_0_does_not_report_the_reform() -> None:
    job = Job(rank=2)  # on n1
    driver(job, Rec(), Link(M1.replace("n2", "s0")), node="n1").recover()
    assert job.epoch == 2 and names(job) == []


def test_with_no_notice_yet_the_rank_reports_the_failure_and_waits_for_the_controller() -> None:
    job, link = Job(), Link()
    link.on_wait = lambda: link.queue.append(M1.replace("n2", "s0"))
    d = driver(job, Rec(), link)
    d.intr.fail("rank 4 timed out")
    d.recover()
    assert job.progress[0] == ("collective_failed", {"error": "rank 4 timed out"})
    assert link.waits == [NOTICE_S] and job.epoch == 2


def test_no_notice_within_the_timeout_stops_the_rank_in_one_line() -> None:
    job, rec = Job(), Rec()
    d = driver(job, rec, Link())
    d.intr.fail("rank 4 timed out")
    with pytest.raises(ResilienceError) as e:
        d.recover()
    assert str(e.value) == "collective failed (rank 4 timed out) and no new membership came within the notice timeout"
    assert rec.log == [] and job.epoch == 1


def test_a_newer_epoch_while_forming_starts_again_at_it() -> None:
    job, link = Job(), Link(M1.replace("n2", "s0"))
    rec = Rec(lambda: (link.queue.append(M1.replace("n2", "s0").replace("n1", "s1")), Reformed("e3"))[1])
    driver(job, rec, link).recover()
    assert [x if x == "retire" else x[:2] for x in rec.log] == ["retire", ("form", 2), "retire", ("form", 3)]
    assert job.epoch == 3 and names(job).count(EventName.GROUP_REFORMED) == 1


def test_an_epoch_already_overtaken_is_retired_but_never_formed() -> None:
    job, rec = Job(), Rec()
    e2 = M1.replace("n2", "s0")
    driver(job, rec, Link(e2, e2.replace("n1", "s1"))).recover()
    assert [x if x == "retire" else x[:2] for x in rec.log] == ["retire", "retire", ("form", 3)]


def test_a_membership_without_this_rank_ends_the_process_as_fenced(monkeypatch: pytest.MonkeyPatch) -> None:
    def exit_(code: int) -> NoReturn:
        raise SystemExit(code)

    monkeypatch.setattr(recovery_driver.os, "_exit", exit_)
    job, rec = Job(), Rec()
    with pytest.raises(SystemExit) as e:
        driver(job, rec, Link(M1.replace("n0", "s0"))).recover()
    assert e.value.code == FENCED_EXIT
    assert rec.log == [] and job.epoch == 1


def test_a_width_the_job_cannot_take_stops_it_with_the_reason() -> None:
    job, rec = Job(rank=2), Rec()
    job.refusal = "its mesh has no 'replicate' dimension (one copy of each shard: plain FSDP2, TP)"
    with pytest.raises(ResilienceError) as e:
        driver(job, rec, Link(M1.shrink("n0")), node="n1").recover()
    assert str(e.value) == (
        "membership epoch 2 moved rank 2 to 0 of 4: this job cannot change width "
        "(its mesh has no 'replicate' dimension (one copy of each shard: plain FSDP2, TP))"
    )
    assert rec.log == [] and job.epoch == 1 and job.resizes == []


def test_a_job_not_attached_yet_cannot_change_width() -> None:
    job = Job(rank=2, attached=False)
    with pytest.raises(ResilienceError, match=r"moved rank 2 to 0 of 4: .* \(not attached yet\)$"):
        driver(job, Rec(), Link(M1.shrink("n0")), node="n1").recover()


def test_two_shrinks_in_one_recovery_tell_the_loop_once_from_the_first_width(
    capsys: pytest.CaptureFixture[str],
) -> None:
    job = Job(rank=2)  # on n1
    e2 = M1.shrink("n0")  # n1: ranks 0, 1 of 4
    link = Link(e2)
    rec = Rec(lambda: (link.queue.append(e2.shrink("n2")), Reformed("e3"))[1])  # n1: ranks 0, 1 of 2
    resizer = Resizer(full_world_size=6)
    seen: list[tuple[int, int]] = []
    resizer.callbacks.append(lambda old, new: seen.append((old, new)))
    driver(job, rec, link, node="n1", resizer=resizer).recover()
    assert job.resizes == [(0, 2), (0, 3)] and (job.rank, job.world_size, job.epoch) == (0, 2, 3)
    assert seen == [(6, 2)]
    assert capsys.readouterr().err == "resild: the job shrank from 6 to 2 ranks\n"
    assert job.events[0][1]["world_size"] == 2  # the reform is reported at the new width


def test_an_old_communicator_that_never_dies_fails_the_rank_in_one_line() -> None:
    d = driver(Job(), Rec(AbortStuck("the old world communicator's abort has not returned in 30s")))
    with pytest.raises(ResilienceError) as e:
        d.form(1, [])
    assert str(e.value) == "the old world communicator's abort has not returned in 30s"
    assert e.value.__suppress_context__  # one line: no chained traceback


def test_groups_that_fail_to_form_run_the_recovery() -> None:
    job, rec = Job(), Rec(Reformed("forming epoch 1: world: timed out"))
    driver(job, rec, Link(M1.replace("n2", "s0"))).form_until_stable(only=["replicate"])
    assert rec.log == [("form", 1, ["replicate"]), "retire", ("form", 2, ["world", "snapshots"])]


def test_groups_that_form_need_no_recovery() -> None:
    job, rec = Job(), Rec()
    driver(job, rec, Link(M1.replace("n2", "s0"))).form_until_stable(only=["replicate"])
    assert rec.log == [("form", 1, ["replicate"])] and job.epoch == 1


def test_a_process_not_attached_yet_forms_its_groups_and_restores_nothing() -> None:
    job = Job(attached=False)
    src = job._sources[0]
    driver(job, Rec(), Link(M1.replace("n2", "s0"))).recover()
    assert job.epoch == 2 and src.needs == [] and names(job) == [EventName.GROUP_REFORMED]


# ---- joining: agree, then restore -------------------------------------------------------
def test_join_restores_from_the_first_source_that_has_the_agreed_step_and_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    job, rec = Job(rank=1, world_size=2, epoch=2), Rec()
    job.floor = 7
    got = Received({}, {}, nbytes=2_000_000, sources=[0], seconds=0.5)
    gone = Source(RestoreSource.REPLICA, "every rank holding step 8 was lost")
    snap = Source(RestoreSource.SNAPSHOT, Restored(8, got, RestoreSource.SNAPSHOT))
    job._sources = [gone, snap]
    d = driver(job, rec)
    d.join()
    assert rec.agreed == [(1, 2, d.steps_state.agreement_row(), 7)]
    assert snap.needs == [Need(8, 7, [8, 8], None)]
    assert job._protocol.log == ["before_write", ("settle", 8, 1), ("resume", got)]
    assert capsys.readouterr().err == "resild: rank 1 replayed 2.00 MB from ranks [0] in 0.500s (4 MB/s) (snapshot)\n"
    name, fields = job.events[0]
    assert name == EventName.STATE_REPLAYED and len(job.events) == 1  # RESUMED is rank 0's
    assert fields["step"] == 8 and fields["bytes"] == 2_000_000 and fields["sources"] == [0]
    assert fields["source"] == "snapshot" and fields["authenticated"] is False  # no data key
    assert job.progress == [("joined", {})]
    assert d.checks.armed == ["the first step after a recovery"]  # type: ignore[attr-defined]


def test_a_state_loaded_in_place_is_not_resumed_and_rank_0_says_the_job_resumed() -> None:
    job = Job(rank=0, world_size=2, epoch=2)
    job._sources = [Source(RestoreSource.CHECKPOINT, Restored(6, None, RestoreSource.CHECKPOINT, loaded=True))]
    driver(job, Rec()).join()
    assert job._protocol.log == ["before_write", ("settle", 8, 0)]
    ((name, fields),) = job.events
    assert name == EventName.RESUMED and fields["step"] == 6 and fields["source"] == "checkpoint"


def test_the_first_join_of_a_job_is_no_recovery() -> None:
    job = Job(rank=0, world_size=2, epoch=1)
    d = driver(job, Rec())
    d.join()
    assert job.events == [] and job.progress == [] and d.checks.armed == []  # type: ignore[attr-defined]
    assert job._protocol.log[-1] == ("resume", None)


def test_diverged_replicas_agree_again_from_their_last_agreed_step() -> None:
    log: list[str] = []
    job, rec = Job(rank=0, world_size=2, epoch=2), Rec()
    job.floor, job.redundancy = 7, Redundancy(log, back=5)
    driver(job, rec).join()
    assert [floor for *_, floor in rec.agreed] == [7, 5]
    assert job._sources[0].needs == [Need(8, 5, [8, 8], None)]
    assert log == ["after_join(8)"]


def test_with_no_source_left_the_job_stops_with_what_each_found() -> None:
    job = Job(rank=0, world_size=2, epoch=2)
    job._sources = [
        Source(RestoreSource.REPLICA, "every rank holding committed step 8 was lost"),
        Source(RestoreSource.SNAPSHOT, "no snapshot step is complete for every rank"),
    ]
    with pytest.raises(ResilienceError):
        driver(job, Rec()).join()
    assert job.fatal == [
        "every rank holding committed step 8 was lost; no snapshot step is complete for every rank" + IMPOSSIBLE
    ]
    assert job._protocol.log == ["before_write", ("settle", 8, 0)]  # nothing resumed
