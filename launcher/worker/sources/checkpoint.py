"""Restore by loading resild's newest complete disk checkpoint on every rank, in-process
(no restart); also how a requeued or resubmitted job resumes, with no user code."""

from __future__ import annotations

import sys
import time

import torch

from launcher.worker.recovery import Reformed
from launcher.worker.redundancy.disk_checkpoint import DiskCheckpointer
from launcher.worker.sources.base import Need, Restored, Unavailable
from launcher.worker.sources.context import SourceContext
from launcher.worker.stable_group import StableGroup
from launcher.worker.step_state import StepState
from launcher.worker.train_state import TrainState
from resild.events.schema import EventName, RestoreSource


class CheckpointSource:
    name = RestoreSource.CHECKPOINT

    def __init__(
        self, ctx: SourceContext, ckpt: DiskCheckpointer, group: StableGroup, state: TrainState, steps: StepState
    ) -> None:
        self.ctx, self.ckpt, self.group, self.state, self.steps = ctx, ckpt, group, state, steps

    @classmethod
    def build(cls, ctx: SourceContext) -> CheckpointSource | None:
        red = ctx.redundancy
        if red is None or red.ckpt is None or red.ckpt_group is None or red.state is None or red.steps is None:
            return None  # no --checkpoint-dir
        return cls(ctx, red.ckpt, red.ckpt_group, red.state, red.steps)

    def restore(self, need: Need, why: str) -> Restored:
        return Restored(self.load(why), None, self.name, loaded=True)

    def fresh_start(self) -> Restored | None:
        if self.saved_step() is None:
            return None
        return Restored(self.load("resuming from resild's checkpoints"), None, self.name, loaded=True)

    def ahead(self) -> None:
        pass  # a load reads the files when it is needed

    def saved_step(self) -> int | None:
        """The newest complete checkpoint as every rank sees it (one all-reduce: a rank
        with a stale listing must not leave the others in DCP's collectives alone)."""
        c = self.ctx
        mine = self.ckpt.newest_complete()
        seen = torch.zeros(c.world_size, dtype=torch.int64, device=self.state.device)
        seen[c.rank] = (mine if mine is not None else -1) + 1
        c.rec.wait(c.rec.groups["world"].pg.allreduce([seen]))
        views = set(c.rec.read(seen))
        if len(views) > 1:
            c.fatal(
                f"ranks see different newest checkpoints in {self.ckpt.directory} (steps "
                f"{sorted(v - 1 for v in views)}): --checkpoint-dir must be one shared file system"
            )
        step = views.pop() - 1
        return step if step >= 0 else None

    def load(self, why: str) -> int:
        """Every rank loads the newest complete checkpoint in place. -> its step."""
        c, ck, state, steps = self.ctx, self.ckpt, self.state, self.steps
        step = self.saved_step()
        if step is None:
            raise Unavailable(f"and no complete checkpoint in {ck.directory} yet")
        t0 = time.monotonic()
        try:
            aux = ck.load(step, state)
        except (OSError, ValueError, RuntimeError) as e:
            if self.group.intr.error is not None:  # a peer, not the files: recover again
                raise Reformed(f"loading checkpoint step {step}: {self.group.intr.error}") from None
            # the files: every rank fails alike (DCP gathers every rank's error)
            raise Unavailable(f"and loading checkpoint step {step} from {ck.directory} failed: {e}"[:1500]) from None
        state.rewind_aux(aux if aux else steps.committed_aux)
        steps.replayed(step, state.capture_aux())
        state.reset_hooks(aux.get("ddp_buckets") if aux else None)
        took = time.monotonic() - t0
        # one write (not print's two): the ranks share one stderr pipe
        sys.stderr.write(f"resild: rank {c.rank} loaded checkpoint step {step} in {took:.3f}s\n")
        if c.rank == 0:
            c.emit(EventName.CHECKPOINT_LOADED, step=step, seconds=round(took, 4), why=why[:300])
        return step
