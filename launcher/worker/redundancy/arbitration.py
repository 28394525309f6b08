"""Two replicas that disagree with no majority: a hot spare arbitrates.

A replica group of two (the common HSDP layout) that disagrees at a fingerprint compare
has no majority to say which copy is right. So:

    compare at D: A and B differ     -> every rank remembers the fingerprints (`Pending`);
                                        the suspect (the higher rank of each such group)
                                        leaves; at the recovery every rank returns to the
                                        last agreed step S (agreed_state), and the spare
                                        that took the suspect's ranks receives S from B
    steps S+1..D computed again       -> the same data position and RNG: the spare redoes
                                        the suspect's part on a fresh device
    compare at D again: `arbitrate`   -> the spare and B agree: the state reproduces beside a
                                        fresh device and the job goes on (on B's first value:
                                        the suspect drifted; else a transient fault whose
                                        gradients reached both). B repeats its first result
                                        against the spare: B is faulty, leaves, and every rank
                                        returns to S again. Anything else: the job stops.

With no spare free the suspect's loss stops the job as any node loss does (the reason
says the replicas disagreed with no majority).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Pending:
    """An arbitration under way: what every rank saw at the compare that found it."""

    step: int  # the compare that found the disagreement (D)
    first: tuple[int, ...]  # every rank's fingerprint then
    pairs: tuple[tuple[int, int], ...]  # (suspect, other) of each group without a majority

    @property
    def suspects(self) -> tuple[int, ...]:
        return tuple(sorted(s for s, _ in self.pairs))


def suspects_of(groups: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, int], ...]:
    """(suspect, other) per group of two that disagrees: the higher rank leaves first (rank 0,
    which speaks for the job, stays). Groups of more have a majority or a real stalemate."""
    return tuple((max(g), min(g)) for g in groups if len(g) == 2)


@dataclass(frozen=True)
class Outcome:
    faulty: tuple[int, ...]  # ranks whose first computation was the wrong one
    leave: tuple[int, ...]  # those of them still in the job: they leave now
    rollback: bool = False  # one of them still disagrees: its gradients reached the others again
    stop: str = ""  # the job cannot be arbitrated: why, in one line


def arbitrate(p: Pending, values: list[int]) -> Outcome:
    """Pure. `values`: every rank's fingerprint at step `p.step`, computed again from the
    last agreed step with a spare in each suspect's place.

    A drift on one replica reaches the other through the averaged gradients, so after a
    transient fault the recomputation usually matches neither first result: what counts
    is whether the pair now agrees (the state reproduces beside a fresh device) and who
    repeats a disagreement (a persistent fault: the same wrong result from the same inputs)."""
    faulty: list[int] = []
    leave: list[int] = []
    for suspect, other in p.pairs:
        spare_v, other_v = values[suspect], values[other]
        if spare_v == other_v:
            if other_v == p.first[other]:
                faulty.append(suspect)  # the other reproduced its own first result: the suspect drifted
        elif other_v == p.first[other]:
            faulty.append(other)  # it repeats its disagreement beside a fresh device: it leaves now
            leave.append(other)
        else:
            return Outcome(
                (),
                (),
                stop=f"replicas {sorted((suspect, other))} disagreed at step {p.step}, and again when computed "
                f"a second time from the last agreed step with a spare in rank {suspect}'s place, each time "
                "differently: the training step does not reproduce; restart from a checkpoint",
            )
    return Outcome(tuple(sorted(faulty)), tuple(sorted(leave)), rollback=bool(leave))
