"""The last agreed state: the rollback plan after a divergence (pure), and a rank's host
copy of its state, restored in place and checked against the agreed fingerprint."""

from __future__ import annotations

import torch

from launcher.worker.redundancy.agreed_state import AgreedCopy, Rollback, plan
from launcher.worker.redundancy.fingerprint import fingerprint
from launcher.worker.redundancy.snapshot_store import body_at
from launcher.worker.step_state import NONE
from launcher.worker.train_state import TrainState


def row(step: int, diverged_at: int = 0, agreed: int = NONE) -> list[int]:
    return [step, 0, 0, diverged_at, agreed]


def test_no_divergence_no_rollback() -> None:
    assert plan([row(25, agreed=20), row(25, agreed=20), row(0)]) is None
    assert plan([[25, 0, 0], [25, 0, 0]]) is None  # rows of an older worker: nothing to say


def test_back_to_the_agreed_step_when_any_rank_saw_the_divergence() -> None:
    # rank 1 missed the verdict (its epoch had failed by then): the others' mark is enough
    rows = [row(25, 25, 20), row(25, 0, 20), row(25, 25, 20), row(0)]
    assert plan(rows) == Rollback(25, 20)
    assert plan(rows).redone == 5  # type: ignore[union-attr]


def test_back_to_the_newest_agreed_step_a_holder_kept() -> None:
    # a rank that kept an older copy (it missed a compare) receives the newer step from a replica;
    # a rank holding nothing (a cut replay) and the spare are not asked
    rows = [row(25, 25, 20), row(25, 25, 15), row(NONE, 25, 10), row(0)]
    assert plan(rows) == Rollback(25, 20)


def test_no_agreed_copy_says_why_the_state_cannot_be_vouched_for() -> None:
    back = plan([row(5, 5), row(5, 5), row(0)])
    assert back is not None and back.step is None and back.redone == 0
    assert "diverged at step 5" in back.unvouched and "no agreed state" in back.unvouched
    # a copy taken at the divergence itself is not an agreed one
    assert plan([row(5, 5, 5), row(5, 5, 5)]).step is None  # type: ignore[union-attr]


def _train() -> TrainState:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return TrainState(model, opt)


def _step(t: TrainState) -> None:
    t.optimizer.zero_grad()
    t.model(torch.randn(4, 8)).sum().backward()
    t.optimizer.step()


def test_a_copy_restores_the_state_in_place_bitwise_and_checks_against_the_agreed_fingerprint() -> None:
    t = _train()
    _step(t)
    copy = AgreedCopy(0, torch.device("cpu"))
    agreed = fingerprint(t.state_view(1))
    copy.keep(1, agreed, t.state_view(1), t.capture_aux())
    assert copy.step == 1 and copy.nbytes > 0
    want = {k: v.clone() for k, v in t.model.state_dict().items()}
    payload = copy.frozen.payload  # type: ignore[union-attr]
    for _ in range(3):
        _step(t)
    assert fingerprint(t.state_view(1)) != agreed
    params = [p.data_ptr() for p in t.model.parameters()]
    state, aux = copy.restore_into(t.state_view(1))[:2]
    t.restore(state, aux)
    assert [p.data_ptr() for p in t.model.parameters()] == params  # written where the live tensors lie
    assert all(torch.equal(want[k], v) for k, v in t.model.state_dict().items())
    assert copy.matches(t.state_view(1))
    # the next agreed compare writes the same buffer again: never two copies in memory
    _step(t)
    copy.keep(2, fingerprint(t.state_view(2)), t.state_view(2), t.capture_aux())
    assert copy.frozen is not None and copy.frozen.payload is payload and copy.kept == 2


def test_a_copy_damaged_in_host_memory_does_not_match() -> None:
    t = _train()
    copy = AgreedCopy(0, torch.device("cpu"))
    copy.keep(0, fingerprint(t.state_view(0)), t.state_view(0), t.capture_aux())
    f = copy.frozen
    assert f is not None
    f.payload[body_at(f.n_skel, f.n_askel, f.n_abuf)] ^= 0x10  # a flipped bit in the first packed tensor's bytes
    state, aux = copy.restore_into(t.state_view(0))[:2]
    t.restore(state, aux)
    assert not copy.matches(t.state_view(0))
    copy.drop()
    assert copy.step == NONE and copy.nbytes == 0
