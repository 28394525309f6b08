"""Run one job: embedded controller (with the rendezvous keys) + a node backend."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.run.join import JoinInfo, mark_ended
from launcher.run.local import LocalCluster
from launcher.run.status import StatusLine, print_summary
from resild.controller.faults import Fault
from resild.controller.journal import Journal
from resild.controller.loop import Controller, ControllerConfig, ControllerFailed
from resild.events.log import EventLog
from resild.procutil import say
from resild.wire.exits import CONTROLLER_LOST_EXIT
from resild.wire.keys import add_join_key, generate_keys
from resild.wire.settings import JobSettings


@dataclass
class JobSpec:
    active: list[str]
    spares: list[str]
    nproc_per_node: int
    cmd: list[str]
    run_dir: Path
    faults: list[Fault] = field(default_factory=list)
    events_path: Path | None = None
    settings: JobSettings = field(default_factory=JobSettings)  # every timeout and interval, validated
    bind_host: str = "127.0.0.1"  # the address peers use to reach the controller
    bind_any: bool = False  # listen on every interface (cluster mode)
    readmit: bool = False  # nodes fenced on suspicion come back as spares (--readmit)
    spare_target: int = 0  # Slurm: cold spares asked of the queue while the pool is below it


def _fake_nvml(spec: JobSpec) -> Path | None:
    """The NVML stand-in lets `--inject xidN` go through the real GPU probe path."""
    try:
        from resild.health.fakenvml import build_fake_nvml
    except ImportError:
        return None
    try:
        return build_fake_nvml(spec.run_dir / "fake-nvml")
    except Exception as e:  # no compiler: GPU probes stay off in the simulation
        if any(f.xid is not None for f in spec.faults):
            raise SystemExit(f"resil-run: cannot build the NVML stand-in needed for Xid injection: {e}") from e
        return None


def run_job(
    spec: JobSpec,
    as_json: bool = False,
    backend_factory: Callable[[str, Path], Any] | None = None,
    return_reason: bool = False,
    status: bool = True,
) -> Any:
    spec.run_dir.mkdir(parents=True, exist_ok=True)
    keys = generate_keys(spec.run_dir / "keys")
    add_join_key(keys)  # the job secret of `resil-run --join`
    job_id = os.urandom(6).hex()
    events = EventLog(spec.events_path)
    live = StatusLine(sys.stderr) if status else None  # stderr only: stdout is --json's
    if live is not None:
        events.listeners.append(live)
    nodes = spec.active + spec.spares
    bind = f"tcp://{'*' if spec.bind_any else spec.bind_host}:0"
    cfg = ControllerConfig(
        bind=bind,
        settings=spec.settings,
        job_id=job_id,
        readmit=spec.readmit,
        spare_target=spec.spare_target,
    )
    ctl = Controller(
        cfg,
        spec.active,
        spec.spares,
        spec.nproc_per_node,
        keys,
        events,
        Journal(spec.run_dir / "journal.jsonl", events=events),
        None,
        spec.faults,
    )
    endpoint = f"tcp://{spec.bind_host}:{ctl.endpoint.rsplit(':', 1)[1]}"
    fake_nvml = _fake_nvml(spec) if backend_factory is None else None
    JoinInfo(
        job_id, endpoint, spec.nproc_per_node, spec.cmd, spec.settings.to_dict(), str(fake_nvml) if fake_nvml else None
    ).write(spec.run_dir)
    if backend_factory is None:
        backend = LocalCluster(
            nodes,
            spec.nproc_per_node,
            spec.cmd,
            spec.run_dir,
            fake_nvml,
            settings=spec.settings,
        )
        backend.start(endpoint, keys.path)
    else:
        backend = backend_factory(endpoint, keys.path)
        backend.start()
    ctl.backend = backend
    try:
        result = ctl.run()
    except KeyboardInterrupt:
        say("resil-run: interrupted")
        mark_ended(spec.run_dir, 130)
        return (130, "interrupted") if return_reason else 130
    except ControllerFailed as e:
        # Our own bug, not the job's verdict: no node was told to shut down (their lease
        # runs out: CONTROLLER_LOST_EXIT, the code a requeue reads). The traceback is logged.
        reason = f"controller failed: {e}"
        say(f"resil-run: {reason} (nodes were not told to stop; see the controller_error event)")
        return (CONTROLLER_LOST_EXIT, reason) if return_reason else CONTROLLER_LOST_EXIT
    finally:
        events.close()
        if live is not None:
            live.close()
    mark_ended(spec.run_dir, result.exit_code)
    print_summary(result.exit_code, result.reason, events.records + list(events.recent_progress), as_json)
    # Said, never silent: the summary above saw less than the job wrote, or the file less than happened.
    if events.records_dropped:
        print(
            f"resil-run: {events.records_dropped} events were over the in-memory cap and are left out of this "
            f"summary (they are in {events.path}: `resild report` reads them all)",
            file=sys.stderr,
        )
    if events.dropped_lines:
        say(f"resil-run: {events.dropped_lines} events could not be written to {events.path}")
    return (result.exit_code, result.reason) if return_reason else result.exit_code
