"""The restore-source loop: order, reasons, the one-line error, a fresh start from disk,
and what adding a source takes (launcher.worker.sources.chain)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from launcher.worker.sources import chain
from launcher.worker.sources.base import IMPOSSIBLE, Need, Restored, StateSource, Unavailable
from launcher.worker.sources.context import SourceContext
from resild.events.schema import RestoreSource

pytestmark = pytest.mark.timeout(30)

NEED = Need(newest=12, floor=12, steps=[12, 0])


@dataclass
class Fake:
    name: RestoreSource
    outcome: int | str  # a step restored, or why not
    fresh: int | None = None
    calls: list[str] = field(default_factory=list)

    def restore(self, need: Need, why: str) -> Restored:
        self.calls.append(why)
        if isinstance(self.outcome, str):
            raise Unavailable(self.outcome)
        return Restored(self.outcome, None, self.name, loaded=self.name is RestoreSource.CHECKPOINT)

    def fresh_start(self) -> Restored | None:
        return None if self.fresh is None else Restored(self.fresh, None, self.name, loaded=True)


def test_the_first_source_that_has_the_state_wins_and_the_rest_are_not_tried() -> None:
    rep, snap = Fake(RestoreSource.REPLICA, 12), Fake(RestoreSource.SNAPSHOT, 10)
    got = chain.restore([rep, snap], NEED)
    assert (got.step, got.source) == (12, RestoreSource.REPLICA)
    assert rep.calls == [""] and snap.calls == []


def test_each_source_is_told_why_the_ones_before_it_could_not() -> None:
    rep = Fake(RestoreSource.REPLICA, "no rank of replica group [1, 3] holds step 12")
    snap = Fake(RestoreSource.SNAPSHOT, "no snapshot step is complete for every rank (x)")
    ck = Fake(RestoreSource.CHECKPOINT, 10)
    got = chain.restore([rep, snap, ck], NEED)
    assert (got.step, got.source, got.loaded) == (10, RestoreSource.CHECKPOINT, True)
    assert ck.calls == [
        "no rank of replica group [1, 3] holds step 12; no snapshot step is complete for every rank (x)"
    ]


def test_with_no_source_left_the_error_is_one_line_that_says_what_each_found() -> None:
    rep = Fake(RestoreSource.REPLICA, "every rank holding committed step 12 was lost")
    snap = Fake(RestoreSource.SNAPSHOT, "no snapshot step is complete for every rank (x)")
    with pytest.raises(chain.Exhausted) as e:
        chain.restore([rep, snap], NEED)
    assert str(e.value) == (
        "every rank holding committed step 12 was lost; no snapshot step is complete for every rank (x)" + IMPOSSIBLE
    )
    # A failed disk checkpoint ends it: no advice to restart from one.
    ck = Fake(RestoreSource.CHECKPOINT, "and no complete checkpoint in /ck yet")
    with pytest.raises(chain.Exhausted) as e:
        chain.restore([rep, ck], NEED)
    assert str(e.value) == "every rank holding committed step 12 was lost; and no complete checkpoint in /ck yet"


def test_a_fresh_start_resumes_from_a_source_that_keeps_state_across_jobs() -> None:
    at_zero = Need(newest=0, floor=0, steps=[0, 0])
    got = chain.restore([Fake(RestoreSource.REPLICA, 0), Fake(RestoreSource.CHECKPOINT, 0, fresh=40)], at_zero)
    assert (got.step, got.source, got.loaded) == (40, RestoreSource.CHECKPOINT, True)
    # nothing on disk: the fresh start stays at 0
    got = chain.restore([Fake(RestoreSource.REPLICA, 0), Fake(RestoreSource.CHECKPOINT, 0)], at_zero)
    assert (got.step, got.source) == (0, RestoreSource.REPLICA)
    # a recovery past step 0 never looks at the disk
    got = chain.restore([Fake(RestoreSource.REPLICA, 12), Fake(RestoreSource.CHECKPOINT, 0, fresh=40)], NEED)
    assert (got.step, got.source) == (12, RestoreSource.REPLICA)


def test_every_source_the_job_can_have_is_listed_once_and_named_by_the_event_schema() -> None:
    built = [make.__self__ for make in chain.SOURCES]  # type: ignore[attr-defined]
    assert [cls.name for cls in built] == list(RestoreSource)


def test_a_fourth_source_is_one_class_and_one_entry_in_the_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """What adding a source takes: a class with build/restore/fresh_start, one entry in
    SOURCES. (Its name would be one more RestoreSource member; a stand-in reuses one.)"""

    class HostCopy:
        name = RestoreSource.SNAPSHOT

        @classmethod
        def build(cls, ctx: SourceContext) -> HostCopy:
            return cls()

        def restore(self, need: Need, why: str) -> Restored:
            return Restored(need.newest, None, self.name)

        def fresh_start(self) -> Restored | None:
            return None

    monkeypatch.setattr(chain, "SOURCES", (HostCopy.build,))
    sources: list[StateSource] = chain.build(None)  # type: ignore[arg-type]
    assert chain.restore(sources, NEED).step == 12
