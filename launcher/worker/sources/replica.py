"""Restore from a live replica's memory: the ranks behind receive the agreed step from
ranks that hold it (launcher.worker.recovery.replay). Nothing is redone."""

from __future__ import annotations

from launcher.worker.replica_map import NoReplica
from launcher.worker.sources.base import IMPOSSIBLE, Need, Restored, Unavailable
from launcher.worker.sources.context import SourceContext
from resild.events.schema import RestoreSource


class ReplicaSource:
    name = RestoreSource.REPLICA

    def __init__(self, ctx: SourceContext) -> None:
        self.ctx = ctx

    @classmethod
    def build(cls, ctx: SourceContext) -> ReplicaSource:
        return cls(ctx)  # always first: a layout without replicas finds no holder and says so

    def restore(self, need: Need, why: str) -> Restored:
        c = self.ctx
        if need.newest < need.floor:
            raise Unavailable(
                f"every rank holding committed step {need.floor} was lost (the newest state left is step {need.newest})"
            )
        try:
            target, got = c.rec.replay(
                need.steps,
                c.replicas(),
                c.rank,
                c.max_sources,
                c.protocol.replica_state,
                c.protocol.receive_into,
                need.landing,
            )
        except (NoReplica, ValueError) as e:  # no holder of some shard, or a damaged transfer
            raise Unavailable(str(e).split(IMPOSSIBLE)[0]) from None
        return Restored(target, got, self.name)

    def fresh_start(self) -> Restored | None:
        return None

    def ahead(self) -> None:
        """The state this rank would send, walked and packed (RecoverySequence.prepare_source)
        while the groups form, if it holds a committed step that a replica of it may lack.
        Survivors mostly stay as they were through the agreement, so the replay starts
        sending at once; the replay checks it is unchanged before using it."""
        c = self.ctx
        if not c.protocol.steps.holding or c.protocol.steps.step < 0:
            return
        mine = next((g for g in c.replicas().groups if c.rank in g), ())
        if len(mine) > 1:
            c.rec.prepare_source(c.protocol.replica_state, c.protocol.replica_token)
