"""Every connection of a new gloo group proves the job's data key before the group is used
(group_auth): over real gloo ranks, a peer without the key (what holds a connection
it took from gloo's pair listener) is refused by name on every rank it talks to; and a
formation whose group fails the proof is retired and reported, never installed."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest
import torch

from launcher.worker.group_auth import AUTH_TAG, PairRefused, expected, group_id, prove_pairs
from launcher.worker.recovery import RecoverySequence, Reformed
from launcher.worker.stable_group import GroupFactory, Interrupts, StableGroup
from launcher.worker.torch_private import hash_store
from launcher.worker.transport.mac import Mac
from tests.launcher.worker.redundancy.test_rollback import in_ranks

pytestmark = pytest.mark.timeout(60)

KEY, OTHER = bytes(range(32)), bytes(32)


def _prove(
    keys: dict[int, bytes], epochs: dict[int, int], rank: int, pg: Any
) -> str | None:  # pragma: no cover - child
    try:
        prove_pairs(pg, Mac(keys.get(rank, KEY)), epochs.get(rank, 5), "world", rank, pg.size(), 10.0)
    except PairRefused as e:
        return str(e)
    return None


def test_every_rank_of_the_job_passes_and_nothing_is_left_on_the_wire() -> None:
    got = in_ranks(3, functools.partial(_prove, {}, {}))
    assert got == {0: None, 1: None, 2: None}  # then the helper's barrier runs on the same group


def test_a_peer_without_the_jobs_key_is_refused_by_name_on_every_rank_it_talks_to() -> None:
    got = in_ranks(3, functools.partial(_prove, {2: OTHER}, {}))
    assert got[0] is not None and "rank(s) [2]" in got[0] and "'world' of epoch 5" in got[0]
    assert got[1] is not None and "rank(s) [2]" in got[1]
    assert got[2] is not None and "rank(s) [0, 1]" in got[2]  # the stranger sees no one prove it either


def test_a_tag_of_another_epoch_does_not_pass_for_this_one() -> None:
    got = in_ranks(2, functools.partial(_prove, {}, {1: 4}))
    assert got[0] is not None and "rank(s) [1]" in got[0]


def test_tags_name_the_direction_the_group_and_the_epoch() -> None:
    mac, g = Mac(KEY), group_id("world")
    tags = {
        tuple(expected(mac, e, gid, s, d))
        for e, gid, s, d in [(5, g, 0, 1), (5, g, 1, 0), (6, g, 0, 1), (5, group_id("host-0"), 0, 1)]
    }
    assert len(tags) == 4 and group_id("world") == g and 0 <= g < 2**63


# ---- wired into the formation -------------------------------------------------------------
class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True


class _FakeGloo:
    """A built group of 2 whose peer (rank 1) sends `tag` in the round."""

    def __init__(self, tag: list[int]) -> None:
        self.tag, self.aborted = tag, threading.Event()

    def name(self) -> str:
        return "gloo"

    def size(self) -> int:
        return 2

    def send(self, ts: list[torch.Tensor], dst: int, tag: int) -> _Done:
        assert tag == AUTH_TAG
        return _Done()

    def recv(self, ts: list[torch.Tensor], src: int, tag: int) -> _Done:
        ts[0].copy_(torch.tensor(self.tag, dtype=torch.int64))
        return _Done()

    def abort(self) -> None:
        self.aborted.set()


class _Factory(GroupFactory):
    def __init__(self, pg: _FakeGloo) -> None:
        super().__init__("gloo", hash_store, 10.0)
        self.pg = pg

    def build(self, epoch: int, group: StableGroup) -> Any:
        return self.pg


def _formed(tag_from_peer: list[int]) -> tuple[RecoverySequence, StableGroup, _FakeGloo]:
    intr = Interrupts()
    pg = _FakeGloo(tag_from_peer)
    rec = RecoverySequence(intr, _Factory(pg), torch.device("cpu"), 0.0)
    rec.mac = Mac(KEY)
    g = StableGroup("world", [0, 1], 0, intr)
    return rec, g, pg


def test_a_group_whose_peer_proves_the_key_is_installed() -> None:
    rec, g, pg = _formed(expected(Mac(KEY), 3, group_id("world"), 1, 0))
    rec.form(3, [g])
    assert g.pg is pg and not pg.aborted.is_set()


def test_a_group_whose_peer_does_not_is_retired_and_the_formation_fails_in_one_line() -> None:
    rec, g, pg = _formed(expected(Mac(OTHER), 3, group_id("world"), 1, 0))
    with pytest.raises(Reformed):
        rec.form(3, [g])
    assert rec.intr.error is not None and "did not prove the job's data key" in rec.intr.error
    assert "rank(s) [1]" in rec.intr.error and g.pg is None
    assert pg.aborted.wait(5)  # handed to the old backends' thread, not leaked


class _Late:
    """A receive that lands after `after_s`, or never (raises at its timeout, as gloo's does)."""

    def __init__(self, after_s: float | None, log: list[float]) -> None:
        self.after_s, self.log = after_s, log

    def wait(self, timeout: Any = None) -> bool:
        left = timeout.total_seconds()
        self.log.append(left)
        if self.after_s is None or self.after_s > left:
            time.sleep(left)
            raise RuntimeError("Timed out waiting for recv")
        time.sleep(self.after_s)
        return True


class _Three:
    """A group of 3 seen from rank 0: rank 1 answers late, rank 2 never."""

    def __init__(self) -> None:
        self.log: list[float] = []

    def send(self, ts: list[torch.Tensor], dst: int, tag: int) -> _Done:
        return _Done()

    def recv(self, ts: list[torch.Tensor], src: int, tag: int) -> _Late:
        ts[0].copy_(torch.tensor(expected(Mac(KEY), 1, group_id("world"), src, 0)))
        return _Late(0.3 if src == 1 else None, self.log)


def test_silent_peers_share_one_deadline_and_are_named() -> None:
    pg = _Three()
    with pytest.raises(PairRefused, match="rank 2 gave no proof within 0.5s"):
        prove_pairs(pg, Mac(KEY), 1, "world", 0, 3, 0.5)
    first, second = pg.log
    assert first == pytest.approx(0.5, abs=0.05) and second < 0.25  # what the late one left, not 0.5 again


def test_a_formation_that_fails_on_one_group_retires_the_groups_it_did_form() -> None:
    intr = Interrupts()
    good = _FakeGloo(expected(Mac(KEY), 3, group_id("world"), 1, 0))

    class Half(GroupFactory):
        def build(self, epoch: int, group: StableGroup) -> Any:
            if group.label == "host":
                raise RuntimeError("the host group did not form")
            return good

    rec = RecoverySequence(intr, Half("gloo", hash_store, 10.0), torch.device("cpu"), 0.0)
    rec.mac = Mac(KEY)
    world, host = StableGroup("world", [0, 1], 0, intr), StableGroup("host", [0, 1], 0, intr)
    with pytest.raises(Reformed):
        rec.form(3, [world, host])
    assert "the host group did not form" in (intr.error or "") and world.pg is None
    assert good.aborted.wait(5)  # not left connected for a formation that will never use it
