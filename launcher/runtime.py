"""The library inside the training process. A data-parallel loop becomes
resilient with a handful of lines (see examples/train.py):

    job = launcher.init(model, optimizer, scheduler=sched)
    for step in job.steps(total):
        ...forward/backward...
        job.commit()

`commit()` all-reduces the gradients together with a health vote and steps the
optimizer only if every rank took part, so replicas can never diverge. When
the controller announces a new membership epoch, whatever collective is in
flight is abandoned (gloo cannot interrupt it, so we stop *waiting* on it),
the old group is aborted and parked, a new group is formed under a fresh
store prefix, the ranks agree on the newest committed step and every rank
behind it receives the full training state from a replica, in one flat buffer.
The same path serves NCCL (GPU) and gloo (CPU).
"""
from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import zmq

from resild.membership import Membership
from resild.protocol import MsgType
from resild.transport import Channel, KeyDir, connect

from .agent_link import AgentLink, agent_endpoint
from .replicas import NoReplica, ReplicaMap, plan_replay
from .state import flatten, unflatten

log = logging.getLogger("resild.runtime")


class _Reformed(Exception):
    """A newer membership epoch arrived: stop what we are doing and re-form."""


class _CollectiveFailed(Exception):
    pass


class ResilienceError(RuntimeError):
    pass


class Job:
    """Handle returned by `launcher.init`. `rank`, `world_size`, `step` are current values."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 extra: Any = None, replicas: Callable[[int], ReplicaMap] | None = None) -> None:
        self.model, self.optimizer, self.scheduler, self.extra = model, optimizer, scheduler, extra
        self._replicas = replicas or ReplicaMap.data_parallel
        self.step = 0
        self.rank, self.world_size, self.epoch = 0, 1, 0
        self.pg: Any = None
        self._graveyard: list[Any] = []  # old groups: never destroyed on the hot path
        self._pending: Membership | None = None
        self._inject_exception = False
        self._commits = 0
        self._shutdown: dict | None = None
        self._finishing = False
        controller = os.environ.get("RESILD_CONTROLLER")
        self.solo = controller is None
        if self.solo:
            return
        self.node = os.environ["RESILD_NODE"]
        self.local_rank = int(os.environ["RESILD_LOCAL_RANK"])
        keys = KeyDir(Path(os.environ["RESILD_KEYS"])) if os.environ.get("RESILD_KEYS") else None
        self.ctx = zmq.Context()
        self.ch: Channel = connect(self.ctx, controller, keys, sender=f"{self.node}/w{self.local_rank}/{os.getpid()}")
        self.ch.send(MsgType.REGISTER_WORKER, {"node": self.node, "local_rank": self.local_rank, "pid": os.getpid()})
        welcome = self._wait_for(MsgType.WELCOME, timeout_s=120.0)
        self.cfg = welcome.body
        self.store = self._store_client()
        self.backend = os.environ.get("RESILD_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
        self.device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self._install_excepthook()
        self._aux = self._capture_aux()
        ep = agent_endpoint()
        self._agent = AgentLink(ep, f"{self.node}/rank{self.local_rank}", lambda: self.step).start() if ep else None
        # A spare waits here, warm: torch imported, model and optimizer built.
        while self._pending is None:
            self._poll(1.0)
        self._recover()

    def _install_excepthook(self) -> None:
        # Interpreter teardown with torch loaded takes ~1-2 s; report the failure first.
        prev = sys.excepthook

        def hook(tp: type, value: BaseException, tb: Any) -> None:
            try:
                if not self.ch.sock.closed:
                    self._send(MsgType.FAILED, local_rank=self.local_rank, pid=os.getpid(),
                               error=f"{tp.__name__}: {value}")
                    self.ch.sock.close(linger=1000)  # flush it: LINGER 0 would drop it at teardown
            except Exception:
                pass  # reporting is best effort; the exit is seen by the node process anyway
            finally:
                prev(tp, value, tb)

        sys.excepthook = hook

    # ---- messages from the controller --------------------------------------
    def _poll(self, timeout_s: float) -> None:
        got = self.ch.recv(timeout_s)
        while got is not None:
            self._on_message(got[1])
            got = self.ch.recv(0)

    def _on_message(self, msg: Any) -> None:
        if msg.type == MsgType.MEMBERSHIP:
            m = Membership.from_dict(msg.body)
            if m.epoch > self.epoch and (self._pending is None or m.epoch > self._pending.epoch):
                self._pending = m
        elif msg.type == MsgType.INJECT and msg.body.get("kind") == "exception":
            self._inject_exception = True
        elif msg.type == MsgType.FENCE:
            os._exit(3)  # a fenced rank must never take part again
        elif msg.type == MsgType.SHUTDOWN:
            self._shutdown = msg.body
            if not self._finishing:
                if int(msg.body.get("exit_code", 1)) == 0:
                    # The job is complete (every rank of the current epoch committed the last
                    # step): a spare never needed, or a rank whose DONE was still in flight.
                    if self.epoch == 0:
                        raise SystemExit(0)
                    return
                raise SystemExit(f"resild: job stopped by the controller: {msg.body.get('reason')}")
        elif msg.type == MsgType.ERROR:
            log.error("controller error: %s", msg.body)
        self._last_msg = msg

    def _wait_for(self, mtype: MsgType, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        self._last_msg = None
        while time.monotonic() < deadline:
            got = self.ch.recv(max(0.0, deadline - time.monotonic()))
            if got is not None:
                self._on_message(got[1])
                if got[1].type == mtype:
                    return got[1]
        raise ResilienceError(f"no {mtype.value} from the controller within {timeout_s:.0f}s "
                              f"({os.environ.get('RESILD_CONTROLLER')})")

    def _send(self, mtype: MsgType, **body: Any) -> None:
        self.ch.send(mtype, {"node": self.node, **body})

    def _event(self, name: str, **fields: Any) -> None:
        self._send(MsgType.EVENT, name=name, fields={"rank": self.rank, "epoch": self.epoch,
                                                      "t_mono": time.monotonic(), **fields})

    # ---- waiting on collectives without trusting their timeouts -------------
    def _check(self) -> None:
        if self._pending is not None and self._pending.epoch > self.epoch:
            raise _Reformed()

    def _wait(self, work: Any, p2p: bool = False) -> None:
        """Wait for `work` while listening to the controller; a newer epoch raises _Reformed.

        gloo's send/recv works never report is_completed() before wait() is
        called, so those are waited on in a helper thread (wait releases the GIL).
        """
        if p2p and self.backend != "nccl":  # NCCL works report completion themselves
            out: dict[str, Exception] = {}

            def waiter() -> None:
                try:
                    work.wait()
                except Exception as e:
                    out["err"] = e

            th = threading.Thread(target=waiter, name="resild-p2p-wait", daemon=True)
            th.start()
            done: Callable[[], bool] = lambda: not th.is_alive()  # noqa: E731
        else:
            done = work.is_completed
            p2p = False
        self._wait_until(done)
        if p2p and self.backend != "nccl":
            if "err" in out:
                raise _CollectiveFailed(str(out["err"]))
            return
        try:
            work.wait()
        except Exception as e:  # gloo: peer reset; NCCL: comm aborted
            raise _CollectiveFailed(str(e)) from None

    def _wait_until(self, done: Callable[[], bool]) -> None:
        """Spin on `done` while serving controller messages; after wait_report_s tell
        the controller we are blocked (the hang detector blames whoever is not),
        and that we are computing again once the wait ends."""
        t0 = time.monotonic()
        nap_s, reported = 0.0001, False
        while not done():
            self._poll(nap_s)
            self._check()
            nap_s = min(nap_s * 2, 0.002)
            if not reported and time.monotonic() - t0 > float(self.cfg.get("wait_report_s", 1.0)):
                self._send(MsgType.PROGRESS, rank=self.rank, epoch=self.epoch, step=self.step, state="wait")
                reported = True
        if reported:
            self._send(MsgType.PROGRESS, rank=self.rank, epoch=self.epoch, step=self.step, state="compute")

    def _await_notice(self, why: str) -> None:
        """Our collective failed: only the controller knows the new membership. The
        report makes it probe every node at once instead of waiting for heartbeats."""
        self._send(MsgType.PROGRESS, rank=self.rank, epoch=self.epoch, step=self.step, state="collective_failed",
                   error=why[:300])
        deadline = time.monotonic() + float(self.cfg.get("notice_timeout_s", 120))
        while time.monotonic() < deadline:
            self._poll(0.05)
            if self._pending is not None and self._pending.epoch > self.epoch:
                return
        raise ResilienceError(f"collective failed ({why}) and no new membership came within the notice timeout")

    # ---- group formation and replay ----------------------------------------
    def _store_client(self) -> Any:
        host, port = self.cfg["store"].rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False,
                             timeout=timedelta(seconds=float(self.cfg.get("store_timeout_s", 60))))

    def _new_group(self, m: Membership, rank: int) -> Any:
        timeout = timedelta(seconds=float(self.cfg.get("collective_timeout_s", 60)))
        if self.backend == "nccl":  # NCCL connects lazily, inside the first (abortable) collective
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            store = dist.PrefixStore(f"resild/e{m.epoch}/", self._store_client())  # own client: see below
            return dist.ProcessGroupNCCL(store, rank, m.world_size, opts)
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        host = os.environ.get("RESILD_GLOO_HOST")
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host) if host
                         else dist.ProcessGroupGloo.create_default_device()]
        out: dict[str, Any] = {}

        def build() -> None:  # connectFullMesh blocks until every rank shows up
            try:
                # Its own store connection: an abandoned formation blocks in store.wait()
                # holding its client, and a shared client would stall the next epoch behind it.
                store = dist.PrefixStore(f"resild/e{m.epoch}/", self._store_client())
                out["pg"] = dist.ProcessGroupGloo(store, rank, m.world_size, opts)
            except Exception as e:
                out["err"] = e

        th = threading.Thread(target=build, name=f"resild-form-e{m.epoch}", daemon=True)
        th.start()
        self._wait_until(lambda: not th.is_alive())  # a newer epoch abandons it (the thread fails on its own)
        if "err" in out:
            raise _CollectiveFailed(f"forming epoch {m.epoch}: {out['err']}")
        return out["pg"]

    def _recover(self) -> None:
        while True:
            self._check_fenced_or_take()
            t0 = time.monotonic()
            try:
                self.pg = self._new_group(self._m, self.rank)
                t_formed = time.monotonic()
                self._rewind_aux()
                steps = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
                steps[self.rank] = self.step
                self._wait(self.pg.allreduce([steps]))
                target, plan = plan_replay(steps.tolist(), self._replica_map())
                nbytes = self._replay(plan)
            except _Reformed:
                continue
            except _CollectiveFailed as e:
                self._await_notice(str(e))
                continue
            except (NoReplica, ValueError) as e:
                # Every rank computes the same plan, so every rank lands here: stop the job.
                self._send(MsgType.FATAL, error=str(e))
                self.ch.sock.close(linger=1000)
                raise ResilienceError(str(e)) from None
            t_done = time.monotonic()
            if self.rank == 0:
                self._event("group_reformed", seconds=round(t_formed - t0, 4), world_size=self.world_size)
            if nbytes:
                self._event("state_replayed", bytes=nbytes, seconds=round(t_done - t_formed, 4), step=target)
            if self.rank == 0:
                self._event("resumed", step=target, seconds=round(t_done - t0, 4))
            return

    def _replica_map(self) -> ReplicaMap:
        rm = self._replicas(self.world_size)
        rm.validate(self.world_size)
        return rm

    def _check_fenced_or_take(self) -> None:
        m = self._pending
        assert m is not None
        self._pending = None
        rank = m.rank_of(self.node, self.local_rank)
        if rank is None:
            os._exit(3)  # not in the new membership: we were fenced
        if self.pg is not None:
            try:
                self.pg.abort()  # NCCL: interrupts pending kernels; gloo: returns at once
            except Exception:
                pass
            self._bury(self.pg)
            self.pg = None
        self._m, self.rank, self.world_size, self.epoch = m, rank, m.world_size, m.epoch

    def _capture_aux(self) -> dict[str, Any]:
        """RNG and `extra` as of the last commit. An abandoned step has consumed
        random numbers (dropout) and advanced the data loader: recovery rewinds
        to this, and replay sends this, never the live state."""
        return {"extra": self.extra.state_dict() if self.extra is not None else None,
                "rng": torch.get_rng_state(), "py_rng": random.getstate(),
                "cuda_rng": torch.cuda.get_rng_state(self.device).cpu() if self.device.type == "cuda" else None}

    def _rewind_aux(self) -> None:
        a = self._aux
        if self.extra is not None and a["extra"] is not None:
            self.extra.load_state_dict(a["extra"])
        torch.set_rng_state(a["rng"])
        random.setstate(a["py_rng"])
        if a["cuda_rng"] is not None:
            torch.cuda.set_rng_state(a["cuda_rng"], self.device)

    def _bury(self, pg: Any) -> None:
        """Keep an aborted group alive until its pending work has timed out (freeing a
        gloo group with threads blocked on a dead peer can deadlock), then drop it off
        the hot path: each group holds world-size sockets, and they must not pile up."""
        self._graveyard.append(pg)
        delay_s = float(self.cfg.get("collective_timeout_s", 60)) + 5.0

        def reap() -> None:
            time.sleep(delay_s)
            try:
                self._graveyard.remove(pg)
            except ValueError:
                pass

        threading.Thread(target=reap, name="resild-reaper", daemon=True).start()

    def _snapshot(self) -> dict[str, Any]:
        return {"step": self.step, "model": self.model.state_dict(), "optim": self.optimizer.state_dict(),
                "sched": self.scheduler.state_dict() if self.scheduler is not None else None, **self._aux}

    def _restore(self, s: dict[str, Any]) -> None:
        self.model.load_state_dict(s["model"])
        self.optimizer.load_state_dict(s["optim"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(s["sched"])
        if self.extra is not None:
            self.extra.load_state_dict(s["extra"])
        torch.set_rng_state(s["rng"])
        v, inner, gauss = s["py_rng"]
        random.setstate((v, tuple(inner), gauss))
        if s["cuda_rng"] is not None:
            torch.cuda.set_rng_state(s["cuda_rng"], self.device)
        self.step = int(s["step"])
        self._aux = self._capture_aux()

    def _replay(self, plan: list[Any]) -> int:
        sends = [t for t in plan if t.src == self.rank]
        recv = next((t for t in plan if t.dst == self.rank), None)
        nbytes = 0
        if sends:
            skel, buf = flatten(self._snapshot())  # on the CPU: model (GPU) and RNG (CPU) state mix
            skel_t = torch.frombuffer(bytearray(skel), dtype=torch.uint8).to(self.device)
            buf = buf.to(self.device)
            header = torch.tensor([len(skel), buf.numel()], dtype=torch.int64, device=self.device)
            works = []
            for t in sends:  # issue all, then wait: receivers proceed in parallel
                works += [self.pg.send([header], t.dst, 1), self.pg.send([skel_t], t.dst, 2), self.pg.send([buf], t.dst, 3)]
            for w in works:
                self._wait(w, p2p=True)
        if recv is not None:
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
            self._wait(self.pg.recv([header], recv.src, 1), p2p=True)
            header = header.cpu()
            skel_t = torch.empty(int(header[0]), dtype=torch.uint8, device=self.device)
            buf = torch.empty(int(header[1]), dtype=torch.uint8, device=self.device)
            self._wait(self.pg.recv([skel_t], recv.src, 2), p2p=True)
            self._wait(self.pg.recv([buf], recv.src, 3), p2p=True)
            self._restore(unflatten(bytes(skel_t.cpu().numpy().tobytes()), buf.cpu()))
            nbytes = buf.numel() + skel_t.numel()
        return nbytes

    # ---- the training loop -------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Yield the step to compute until `total` steps are committed; after a
        recovery the next step yielded is the agreed committed step."""
        while True:
            while self.step < total:
                before = self._commits
                yield self.step
                if self._commits == before:
                    raise ResilienceError("call job.commit() once per step inside `for step in job.steps(...)`")
            if self.solo or self._finish():
                return

    def _finish(self) -> bool:
        """Report done, then stay available as a replica until the controller
        says the whole job is done (a late failure may still need our state)."""
        self._finishing = True
        self._send(MsgType.DONE, rank=self.rank, epoch=self.epoch, step=self.step, pid=os.getpid())
        deadline = time.monotonic() + float(self.cfg.get("notice_timeout_s", 120))
        while self._shutdown is None:
            if time.monotonic() > deadline:
                raise ResilienceError("finished, but the controller never confirmed the end of the job")
            self._poll(0.05)
            if self._pending is not None:
                self._finishing = False
                self._recover()
                return False
        return True

    def commit(self) -> bool:
        """All-reduce gradients; step optimizer and scheduler only if the
        all-reduce completed, i.e. every rank took part. Returns False if the step was abandoned
        (a recovery ran; the loop resumes at the agreed committed step)."""
        self._commits += 1
        if self.solo:
            self._apply_step()
            return True
        if self._inject_exception:
            raise RuntimeError("resild fault injection: exception raised in the training step")
        params = [p for p in self.model.parameters() if p.requires_grad]
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        try:
            self._poll(0)
            self._check()
            self._wait(self.pg.allreduce([flat]))
        except _Reformed:
            self._recover()
            return False
        except _CollectiveFailed as e:
            self._await_notice(str(e))
            self._recover()
            return False
        # The all-reduce completed, so every rank contributed: that is the commit vote
        # (a separate vote element would saturate in bf16 beyond 256 ranks).
        flat.div_(self.world_size)
        offset = 0
        for p in params:
            n = p.numel()
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.copy_(flat[offset:offset + n].view_as(p))
            offset += n
        self._apply_step()
        self._aux = self._capture_aux()
        self._send(MsgType.PROGRESS, rank=self.rank, epoch=self.epoch, step=self.step, state="commit")
        return True

    def _apply_step(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1

    def close(self) -> None:
        if not self.solo:
            if self._agent is not None:
                self._agent.stop()
            self.ch.close()
            self.ctx.term()


def init(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None, *, extra: Any = None,
         replicas: Callable[[int], ReplicaMap] | None = None) -> Job:
    """Join the job (or, run without resil-run, train alone). A spare worker blocks
    here, fully built, until the controller gives it a failed node's ranks."""
    try:
        return Job(model, optimizer, scheduler, extra, replicas)
    except ResilienceError as e:
        print(f"resild: {e}", file=sys.stderr)
        raise SystemExit(2) from None
