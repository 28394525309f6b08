"""resil-run --controllers N (N >= 2): the controller as a replica set.

resil-run starts N controller replicas (`python -m resild.controller.replica`, separate
processes, each with its own endpoint and journal copy) and the
node processes, which hold every replica's endpoint and follow the leader. Then it
only waits: the job's verdict is the leader's (`result.json` in the run directory),
and if every replica is gone the node processes end on their lease.

The replicas elect their leader and keep the journal in etcd: the job's own cluster of
N members (--local: on this machine, started and stopped here) or a site's (--etcd).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from launcher.run.job import JobSpec, _fake_nvml
from launcher.run.local import LocalCluster
from launcher.run.status import StatusLine, print_summary
from resild.controller.etcd_cluster import (
    LocalEtcd,
    slurm_target,
    wait_for_member_certs,
    wait_for_members,
    wait_ready,
)
from resild.controller.etcd_election import lease_ttl_s
from resild.controller.etcd_target import EtcdTarget
from resild.controller.etcd_tls import forget_ca_key, make_certs
from resild.controller.replica import RUNNER_ALIVE, wait_for_replicas
from resild.controller.verdict_file import RESULT_FILE
from resild.events.log import RECENT_PROGRESS, EventTail
from resild.events.schema import EventName
from resild.procutil import die_with_parent, say
from resild.wire.keys import generate_keys


def run_replicated(
    spec: JobSpec,
    n_controllers: int,
    as_json: bool = False,
    *,
    slurm_job: Any = None,
    node_cmd: Callable[[str, Path], list[str]] | None = None,
    status: bool = True,
    etcd: EtcdTarget | None = None,
    resume: bool = False,
) -> int:
    """`slurm_job` (an Allocation) and `node_cmd(endpoints, keys_dir)` under
    Slurm: the replicas run on the allocation's first N nodes (one srun step), the node
    processes as usual; otherwise every process runs on this machine. `etcd`: a site's
    etcd (its prefix this job's own) instead of the job's own cluster. `resume`: the job's
    own etcd in the run directory is started again as it was (the journal with it)."""
    rd = spec.run_dir
    rd.mkdir(parents=True, exist_ok=True)
    for stale in [*([] if resume else [rd / RESULT_FILE]), *rd.glob("replica-*.json")]:
        stale.unlink(missing_ok=True)
    keys = generate_keys(rd / "keys")
    own_etcd: LocalEtcd | None = None
    resume_records = 0  # the journal's length when this run resumed it
    etcd_step: subprocess.Popen[bytes] | None = None
    if etcd is None:
        try:
            if slurm_job is None:
                own_etcd = LocalEtcd(rd, keys.path, n_controllers, fresh=not resume)
                if resume and not own_etcd.has_data():
                    over = _over(rd)
                    print(
                        f"resil-run: {rd}: the job's etcd data is gone (removed when the job ended)"
                        + ("" if over is None else "; the job is over"),
                        file=sys.stderr,
                    )
                    return 1 if over is None else over
                etcd = own_etcd.start()
                if resume:
                    over, resume_records = _finished(etcd, rd)
                    if over is not None:
                        own_etcd.stop()
                        return over
                (rd / RESULT_FILE).unlink(missing_ok=True)
            else:
                etcd_step, etcd = _slurm_etcd(slurm_job, spec.active + spec.spares, n_controllers, rd, keys.path)
        except (RuntimeError, OSError, ValueError) as e:
            say(f"resil-run: {e}")
            return 1
    events_path = spec.events_path or rd / "events.jsonl"
    tail = EventTail(events_path, from_end=True)  # before any replica runs; an --events file may hold older jobs
    nodes_all = spec.active + spec.spares
    cfg: dict[str, Any] = {
        "active": spec.active,
        "spares": spec.spares,
        "nproc": spec.nproc_per_node,
        "keys": str(keys.path),
        "events": str(events_path),
        "run_dir": str(rd),
        "faults": [str(f) for f in spec.faults],
        "settings": spec.settings.to_dict(),
    }
    if etcd is not None:
        cfg["etcd"] = etcd.to_dict()
        cfg["lease_ttl_s"] = lease_ttl_s(spec.settings.controller_timeout_s)
    if resume:
        cfg["resume_records"] = resume_records
    if slurm_job is not None:
        if len(nodes_all) < n_controllers:
            print(
                f"resil-run: --controllers {n_controllers} needs as many nodes; the job has {len(nodes_all)}",
                file=sys.stderr,
            )
            return 2
        cfg["hosts"] = nodes_all[:n_controllers]  # the batch host and the next ones: a majority survives any one
    else:  # each replica binds its own port and publishes it (never a port nobody listens on)
        cfg["replicas"], cfg["advertise"] = n_controllers, spec.bind_host
    spec_file = rd / "controllers.json"
    spec_file.write_text(json.dumps(cfg, indent=2))
    replica_cmd = [sys.executable, "-m", "resild.controller.replica", "--spec", str(spec_file)]
    if slurm_job is not None:
        from resild import slurm

        replicas = [
            subprocess.Popen(slurm.srun_node_launcher_cmd(slurm_job, cfg["hosts"], replica_cmd), start_new_session=True)
        ]
    else:
        replicas = [
            subprocess.Popen([*replica_cmd, "--index", str(i)], start_new_session=True, preexec_fn=die_with_parent)
            for i in range(n_controllers)
        ]
    alive = rd / RUNNER_ALIVE
    backend: Any = None
    # The live status line, as with one controller, from the leaders' event file (several
    # processes, maybe hosts, write it): wall time orders it across them.
    live: StatusLine | None = StatusLine(sys.stderr) if status else None
    # This job's events for the summary (an --events file may hold older jobs): all but
    # `progress`, of which the latest (weeks of 2/s would fill memory), as EventLog keeps them.
    seen: list[dict[str, Any]] = []
    progress: deque[dict[str, Any]] = deque(maxlen=RECENT_PROGRESS)

    def follow() -> bool:
        """Feed the status line and the summary; True once this job has a leader."""
        nonlocal live
        led = False
        for e in tail.poll():
            led = led or e.get("event") == EventName.CONTROLLER_LEADER
            (progress if e.get("event") == EventName.PROGRESS else seen).append(e)
            if live is not None and isinstance(e.get("t_wall"), (int, float)):
                try:
                    live({**e, "t_log": e["t_wall"]})
                except Exception as err:  # a display bug must never take the job down
                    say(f"resil-run: live status stopped: {err!r}")
                    live = None
        return led

    try:
        endpoints = wait_for_replicas(rd, n_controllers, 120.0)
        # Nodes start once a leader is there: their lease runs from their start.
        deadline = time.monotonic() + 120.0
        while not follow():
            if time.monotonic() > deadline or all(r.poll() is not None for r in replicas):
                print(
                    f"resil-run: the controller replicas elected no leader within 120s (logs: {rd}/replica-*.log)",
                    file=sys.stderr,
                )
                return 1
            time.sleep(0.05)
        if slurm_job is not None:
            from launcher.run.slurm_backend import SlurmBackend

            assert node_cmd is not None
            backend = SlurmBackend(
                slurm_job, nodes_all, node_cmd(",".join(endpoints), keys.path), drain_nodes=False
            )  # the leader drains
            backend.start()
            running: Callable[[], bool] = lambda: backend.proc.poll() is None  # noqa: E731
        else:
            backend = LocalCluster(
                nodes_all,
                spec.nproc_per_node,
                spec.cmd,
                rd,
                _fake_nvml(spec),
                settings=spec.settings,
            )
            backend.start(",".join(endpoints), keys.path)
            running = lambda: any(p.poll() is None for p in backend.procs.values())  # noqa: E731
        # The leader decides; we wait for every node process to end (SHUTDOWN, fencing,
        # or their lease when no replica is left), telling the leader we are still here.
        while running():
            alive.touch()
            follow()
            if own_etcd is not None:
                own_etcd.restart_dead()
            time.sleep(0.25)
    except KeyboardInterrupt:
        say("resil-run: interrupted")
        return 130
    except RuntimeError as e:
        say(f"resil-run: {e}")
        return 1
    finally:
        deadline = time.monotonic() + 5.0
        while (
            not (rd / RESULT_FILE).exists() and any(r.poll() is None for r in replicas) and time.monotonic() < deadline
        ):
            alive.touch()
            time.sleep(0.05)  # the leader writes its verdict after the nodes it shut down are gone
        alive.touch()
        for r in replicas:
            if r.poll() is None:
                os.killpg(r.pid, signal.SIGTERM if slurm_job is not None else signal.SIGKILL)
            gone_by = time.monotonic() + 15.0
            while r.poll() is None and time.monotonic() < gone_by:
                alive.touch()  # until the leader is gone: it must not take us for lost (end_orphaned_job)
                time.sleep(0.1)
            if r.poll() is None:
                os.killpg(r.pid, signal.SIGKILL)
                r.wait()
        if backend is not None:
            backend.shutdown(0.0)
        if own_etcd is not None:
            if (rd / RESULT_FILE).exists():  # the job is over: its etcd's data goes (the journal copies stay)
                own_etcd.remove_data()
            else:  # kept for --resume
                own_etcd.stop()
        if etcd_step is not None:
            _stop_step(etcd_step)
        follow()
        if live is not None:
            live.close()
    try:
        result = json.loads((rd / RESULT_FILE).read_text())
        code, reason = int(result["exit_code"]), str(result["reason"])
    except (OSError, ValueError, KeyError):
        code, reason = (
            1,
            f"every controller replica was lost ({n_controllers}); the node processes ended on their lease",
        )
    records = seen + list(progress)
    leaders = [
        {k: e.get(k) for k in ("pid", "host", "term", "index", "restored")}
        for e in records
        if e["event"] == EventName.CONTROLLER_LEADER
    ]
    print_summary(code, reason, records, as_json, {"controllers": n_controllers, "leaders": leaders})
    return code


def _slurm_etcd(
    alloc: Any, nodes: list[str], n: int, rd: Path, keys_dir: Path
) -> tuple[subprocess.Popen[bytes], EtcdTarget]:
    """The job's own etcd under Slurm: one member on each of the allocation's first n nodes
    (the replicas' hosts), one srun step; its target once a quorum answers."""
    from resild import slurm

    hosts = nodes[:n]
    certs = make_certs(keys_dir, members_sign=True)  # the CA key lives until every member signed
    (rd / "etcd").mkdir(mode=0o700, exist_ok=True)
    for stale in (rd / "etcd").glob("member-*.json"):
        stale.unlink()
    cmd = [
        sys.executable,
        "-m",
        "resild.controller.etcd_cluster",
        "--run-dir",
        str(rd),
        "--keys",
        str(keys_dir),
        "--hosts",
        ",".join(hosts),
    ]
    step = subprocess.Popen(slurm.srun_node_launcher_cmd(alloc, hosts, cmd), start_new_session=True)
    try:
        alive = lambda: step.poll() is None  # noqa: E731
        members = wait_for_members(rd, n, 120.0, alive)
        target = slurm_target(members, certs, os.environ.get("SLURM_JOB_ID") or rd.name)
        wait_ready(target, 60.0, alive)
        wait_for_member_certs(keys_dir, [m.name for m in members], 60.0, alive)
    except BaseException:
        _stop_step(step)
        raise
    finally:
        forget_ca_key(keys_dir)  # node processes (same user, same file system) must not mint certificates
    return step, target


def _stop_step(p: subprocess.Popen[bytes]) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGTERM)
    try:
        p.wait(15.0)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def _finished(etcd: EtcdTarget, rd: Path) -> tuple[int | None, int]:
    """A resumed job that its last leader closed: its verdict (said again), or None; and
    the number of records in its journal."""
    from resild.controller.etcd_client import Etcd
    from resild.controller.etcd_journal import read_records

    records = [r for _, r in read_records(Etcd(etcd), etcd.prefix)]
    if not any(r.get("action") == "closed" for r in records):
        say(f"resil-run: resuming the job of {rd} ({len(records)} journal records)")
        return None, len(records)
    code = _over(rd)
    return (1 if code is None else code), len(records)


def _over(rd: Path) -> int | None:
    """The verdict of the job of `rd`, said again; None if it has none."""
    try:
        result = json.loads((rd / RESULT_FILE).read_text())
        code, reason = int(result["exit_code"]), str(result["reason"])
    except (OSError, ValueError, KeyError):
        return None
    say(f"resil-run: the job of {rd} is over (exit {code}: {reason}); nothing to resume")
    return code
