"""bench/snapshots.py without running a job: its analysis on a small synthetic event
stream (the events resild and the torchrun worker write), and ``--help``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.snapshots import (
    FALLBACK_COLS,
    VARIANTS,
    _with_snapshots,
    fallback_recovery,
    overhead_rows,
    resild_fallback_cmd,
    resild_recovery,
    snapshot_stats,
    summarize_fallback,
    summarize_recovery,
    torchrun_fault_cmd,
    torchrun_recovery,
)

REPO = Path(__file__).resolve().parents[2]
LAYOUT = {"local-node0": [0, 1], "local-node1": [2, 3]}


def _snap(rank: int, taken: int = 100, capture_s: float = 0.3, held: int = 3_600_000, t: float = 0.0) -> dict:
    return {
        "event": "snapshots",
        "t_mono": 50.0 + t,
        "t_wall": 1050.0 + t,
        "rank": rank,
        "epoch": 1,
        "copies": 1,
        "every": 1,
        "taken": taken,
        "skipped": 0 if rank else 2,
        "capture_s": capture_s,
        "exchange_s": 0.01,
        "held_bytes": held,
    }


def resild_events(redone: int = 0) -> list[dict]:
    """A plain FSDP2 node loss: node1 killed at step 60, node2 takes over in epoch 2."""
    ev = [
        ("job_started", 0.0, {"nodes": ["local-node0", "local-node1", "local-node2"]}),
        ("membership", 5.0, {"epoch": 1, "layout": LAYOUT}),
        ("full_strength_step", 6.0, {"epoch": 1, "step": 1, "rank": 0}),
        ("fault_injected", 10.0, {"kind": "kill", "node": "local-node1", "step": 60, "spec": "kill:local-node1@60"}),
        ("failure_detected", 10.04, {"node": "local-node1", "cause": "signal 9", "committed_step": 60}),
        ("node_fenced", 10.05, {"node": "local-node1"}),
        (
            "spare_assigned",
            10.06,
            {"spare": "local-node2", "failed": "local-node1", "epoch": 2, "ranks": [2, 3], "spares_left": 0},
        ),
        ("membership", 10.07, {"epoch": 2, "layout": {"local-node0": [0, 1], "local-node2": [2, 3]}}),
        ("group_reformed", 10.20, {"rank": 0, "epoch": 2, "seconds": 0.12, "world_size": 4}),
        ("rolled_back", 10.25, {"rank": 0, "epoch": 2, "step": 60 - redone, "newest": 60, "steps_redone": redone}),
        ("resumed", 10.26, {"rank": 0, "epoch": 2, "step": 60 - redone, "seconds": 0.18, "source": "snapshot"}),
        ("state_replayed", 10.27, {"rank": 2, "epoch": 2, "bytes": 1_200_000, "seconds": 0.03, "sources": [0]}),
        ("state_replayed", 10.28, {"rank": 3, "epoch": 2, "bytes": 1_200_000, "seconds": 0.02, "sources": [1]}),
        ("full_strength_step", 10.50, {"epoch": 2, "step": 61 - redone, "rank": 0}),
    ]
    out = [{"event": name, "t_mono": t, "t_wall": 1000.0 + t, **f} for name, t, f in ev]
    for e in out:
        if e["event"] == "state_replayed":
            e["source"] = "snapshot"
    return out + [_snap(r, t=i) for i, r in enumerate((0, 1, 2, 3))]


def torchrun_events(nproc: int = 4, kill_at: int = 60, resumed: int = 50) -> list[dict]:
    """bench/sharded_train.py --mode plain --model fsdp --events: a kill, a restart from a checkpoint."""
    ev: list[dict] = []

    def add(event: str, t: float, rank: int, rc: int, **f) -> None:
        ev.append({"event": event, "rank": rank, "pid": 100 * rc + rank, "restart_count": rc, "t_wall": t, **f})

    for r in range(nproc):
        add("start", 0.0, r, 0)
        add("ready", 5.0, r, 0, resumed_step=0)
    for k in range(kill_at):
        for r in range(nproc):
            add("step", 6.0 + 0.1 * k, r, 0, step=k)
    t_f = 6.0 + 0.1 * kill_at
    add("fault_injected", t_f, 2, 0, step=kill_at)
    for r in range(nproc):
        add("start", t_f + 0.5, r, 1)
        add(
            "ready",
            t_f + 8.0,
            r,
            1,
            resumed_step=resumed,
            t_torch_imported=t_f + 2.0,
            t_group_ready=t_f + 5.0,
            t_model_built=t_f + 7.0,
            t_ckpt_loaded=t_f + 8.0,
            t_wrapped=t_f + 8.0,
        )
        for k in range(resumed, kill_at + 5):
            add("step", t_f + 8.2 + 0.1 * (k - resumed), r, 1, step=k)
    return sorted(ev, key=lambda e: e["t_wall"])


def test_snapshot_stats_medians_over_ranks() -> None:
    evs = [_snap(0, capture_s=0.2), _snap(1, capture_s=0.4), _snap(2, taken=50, capture_s=0.5), _snap(3)]
    s = snapshot_stats(evs)
    assert s["ranks_reporting"] == 4
    assert s["taken"] == 100 and s["copies"] == 1 and s["every"] == 1
    assert s["skipped"] == 0
    assert s["held_bytes"] == 3_600_000
    assert s["capture_per_snapshot_s"] == pytest.approx(0.0035)  # median of 2, 4, 10 and 3 ms
    assert snapshot_stats([])["taken"] is None


def test_overhead_rows_ratio_memory_and_pairs() -> None:
    snaps = snapshot_stats([_snap(r) for r in range(4)])
    runs = [
        {"variant": "plain", "repeat": 1, "step_s": 0.100, "commit_s": 0.002, "compute_s": 0.09, "exit_code": 0},
        {"variant": "plain", "repeat": 2, "step_s": 0.110, "commit_s": 0.002, "compute_s": 0.09, "exit_code": 0},
        {"variant": "k1", "repeat": 1, "step_s": 0.120, "exit_code": 0, "state_bytes": 1_200_000, "snapshots": snaps},
        {"variant": "k1", "repeat": 2, "step_s": 0.121, "exit_code": 1, "state_bytes": 1_200_000, "snapshots": snaps},
    ]
    rows = {r["variant"]: r for r in overhead_rows(runs, ["plain", "k1"])}
    assert rows["plain"]["ratio"] == pytest.approx(1.0)
    k1 = rows["k1"]
    assert k1["step_ms"] == pytest.approx(120.5)
    assert k1["ratio"] == pytest.approx(120.5 / 105.0)
    assert k1["pair_ratio_min"] == pytest.approx(1.1) and k1["pair_ratio_max"] == pytest.approx(1.2)
    assert k1["held_x"] == pytest.approx(3.0)
    assert k1["capture_ms"] == pytest.approx(3.0)
    assert k1["capture_pct"] == pytest.approx(100 * 3.0 / 120.5)
    assert k1["taken"] == 100 and k1["failed_runs"] == 1
    assert rows["plain"]["held_kb"] is None


@pytest.mark.parametrize("redone", [0, 3])
def test_resild_recovery_phases_and_rollback(redone: int) -> None:
    r = resild_recovery(resild_events(redone), step_s=0.1)
    assert r["total_s"] == pytest.approx(0.5)
    assert r["detect_s"] == pytest.approx(0.04)
    assert r["rolled_back_to"] == 60 - redone and r["rolled_back_newest"] == 60
    assert r["steps_redone"] == redone
    assert r["work_lost_s"] == pytest.approx(0.1 * redone)
    assert r["caught_up_s"] == pytest.approx(0.5 + 0.1 * redone)
    assert r["replay_bytes"] == 2_400_000 and r["replay_sources"] == [0, 1] and r["replay_source"] == "snapshot"
    phases = ("detect_s", "fence_s", "reform_s", "replay_s", "first_step_s")
    assert sum(r[k] for k in phases) == pytest.approx(r["total_s"])


def test_resild_recovery_without_a_failure() -> None:
    r = resild_recovery([e for e in resild_events() if e["event"] in ("job_started", "membership")], step_s=0.1)
    assert r["total_s"] is None and r["steps_redone"] is None and r["step_s"] == 0.1


def test_torchrun_recovery_and_the_ratio() -> None:
    t = torchrun_recovery(torchrun_events(), nproc=4, kill_at=60)
    assert t["resumed_step"] == 50 and t["steps_redone"] == 10
    assert t["total_s"] == pytest.approx(8.2)
    assert t["step_s"] == pytest.approx(0.1)
    assert t["work_lost_s"] == pytest.approx(1.0)
    assert t["caught_up_s"] == pytest.approx(9.2)
    r = resild_recovery(resild_events(), step_s=0.1)
    s = summarize_recovery([r], [t])
    assert s["speedup"] == pytest.approx(8.2 / 0.5)
    assert s["speedup_caught_up"] == pytest.approx(9.2 / 0.5)


def test_snapshot_flags_go_before_the_worker_command() -> None:
    cmd = _with_snapshots(["resil-run", "--local", "--", "python", "w.py", "--steps", "3"], 2, 5)
    assert cmd == ["resil-run", "--local", "--snapshot-copies", "2", "--snapshot-every", "5", "--", "python"] + [
        "w.py",
        "--steps",
        "3",
    ]
    assert VARIANTS["plain"] is None and VARIANTS["k2"] == 2


def fallback_events(ckpt_step: int = 50, kill_at: int = 60) -> list[dict]:
    """Part 3: node0 and node1 (rank 0 and its only snapshot copy) lost at step 60, each a
    failure of its own (epochs 2 and 3); epoch 3 loads resild's checkpoint of step 50."""
    one = {"local-node0": [0], "local-node1": [1], "local-node2": [2]}
    ev = [
        ("job_started", 0.0, {"nodes": [f"local-node{i}" for i in range(5)]}),
        ("membership", 5.0, {"epoch": 1, "layout": one}),
        ("full_strength_step", 6.0, {"epoch": 1, "step": 1, "rank": 0}),
        ("fault_injected", 10.0, {"kind": "nodeloss", "node": "local-node0", "step": kill_at}),
        ("fault_injected", 10.01, {"kind": "nodeloss", "node": "local-node1", "step": kill_at}),
        ("failure_detected", 10.05, {"node": "local-node0", "cause": "node lost", "committed_step": kill_at}),
        ("node_fenced", 10.06, {"node": "local-node0"}),
        ("spare_assigned", 10.07, {"spare": "local-node3", "failed": "local-node0", "epoch": 2, "spares_left": 1}),
        ("membership", 10.08, {"epoch": 2, "layout": {**one, "local-node3": [0]}}),
        ("failure_detected", 10.11, {"node": "local-node1", "cause": "node lost", "committed_step": kill_at}),
        ("node_fenced", 10.12, {"node": "local-node1"}),
        ("spare_assigned", 10.13, {"spare": "local-node4", "failed": "local-node1", "epoch": 3, "spares_left": 0}),
        ("membership", 10.14, {"epoch": 3, "layout": {"local-node3": [0], "local-node4": [1], "local-node2": [2]}}),
        ("group_reformed", 10.40, {"rank": 0, "epoch": 3, "seconds": 0.2, "world_size": 3}),
        ("checkpoint_loaded", 10.85, {"rank": 0, "epoch": 3, "step": ckpt_step, "seconds": 0.4, "why": "x"}),
        ("resumed", 10.90, {"rank": 0, "epoch": 3, "step": ckpt_step, "seconds": 0.7, "source": "checkpoint"}),
        ("full_strength_step", 11.20, {"epoch": 3, "step": ckpt_step + 1, "rank": 0}),
    ]
    return [{"event": name, "t_mono": t, "t_wall": 1000.0 + t, **f} for name, t, f in ev]


def test_fallback_recovery_from_the_first_fault_to_full_strength() -> None:
    r = fallback_recovery(fallback_events(), step_s=0.1)
    assert r["failures"] == 2 and r["nodes_lost"] == ["local-node0", "local-node1"]
    assert r["recovered_from"] == "checkpoint" and r["outcome"] == "recovered"
    assert r["total_s"] == pytest.approx(1.2)  # the first fault (10.0) → full strength (11.2)
    assert r["detect_s"] == pytest.approx(0.11)  # → the last failure detected
    assert r["fence_s"] == pytest.approx(0.01)
    assert r["reform_s"] == pytest.approx(0.4 - 0.12)  # resumed 10.9 - (0.7 - 0.2) = formed at 10.4
    assert r["load_s"] == pytest.approx(0.5)
    assert r["first_step_s"] == pytest.approx(0.3)
    phases = ("detect_s", "fence_s", "reform_s", "load_s", "first_step_s")
    assert sum(r[k] for k in phases) == pytest.approx(r["total_s"])
    assert r["ckpt_step"] == 50 and r["ckpt_load_s"] == pytest.approx(0.4) and r["resumed_step"] == 50
    assert r["steps_redone"] == 10
    assert r["work_lost_s"] == pytest.approx(1.0)
    assert r["caught_up_s"] == pytest.approx(2.2)


def test_fallback_without_a_checkpoint_recovery_reports_the_failures_only() -> None:
    evs = [e for e in fallback_events() if e["event"] not in ("resumed", "checkpoint_loaded")]
    evs = [e for e in evs if not (e["event"] == "full_strength_step" and e["epoch"] == 3)]
    r = fallback_recovery(evs, step_s=0.1)
    assert r["total_s"] is None and r["ckpt_step"] is None and r["steps_redone"] is None
    assert r["failures"] == 2 and r["outcome"] == "not recovered" and r["step_s"] == 0.1


def test_fallback_side_by_side_and_the_ratio() -> None:
    rs = [fallback_recovery(fallback_events(), step_s=0.1), fallback_recovery(fallback_events(40), step_s=0.1)]
    tr = [torchrun_recovery(torchrun_events(nproc=3, resumed=50), nproc=3, kill_at=60)]
    assert tr[0]["total_s"] == pytest.approx(8.2) and tr[0]["steps_redone"] == 10
    s = summarize_fallback(rs, tr)
    assert s["resild"]["total_s"] == pytest.approx(1.2) and s["resild"]["steps_redone"] == 15
    assert s["resild"]["ckpt_step"] == 45
    assert s["speedup"] == pytest.approx(8.2 / 1.2)
    assert s["speedup_caught_up"] == pytest.approx(9.2 / (1.2 + 1.5))
    rows = {r["side"]: r for r in s["rows"]}
    assert set(rows) == {"resild", "torchrun", "torchrun/resild"}
    assert rows["resild"]["runs"] == 2 and rows["torchrun"]["runs"] == 1
    assert rows["torchrun"]["ckpt_step"] == 50 and rows["torchrun"]["steps_redone"] == 10
    assert rows["torchrun/resild"]["total_s"] == pytest.approx(s["speedup"])
    assert all(set(r) <= {"side", *FALLBACK_COLS} for r in s["rows"])


def test_fallback_commands(tmp_path: Path) -> None:
    import argparse

    args = argparse.Namespace(fault_steps=120, kill_at=60, ckpt_every=50, fault_every=1, fault_ppn=2)
    cmd = resild_fallback_cmd(args, tmp_path, python="py")
    head = cmd[: cmd.index("--")]
    for flag, value in (
        ("--nodes", "5"),
        ("--spares", "2"),
        ("--nproc-per-node", "1"),
        ("--snapshot-copies", "1"),
        ("--checkpoint-dir", str(tmp_path / "ckpt")),
        ("--checkpoint-every", "50"),
    ):
        assert head[head.index(flag) + 1] == value, (flag, head)
    assert [head[i + 1] for i, a in enumerate(head) if a == "--inject"] == ["nodeloss:node0@60", "nodeloss:node1@60"]
    tail = cmd[cmd.index("--") :]
    assert tail[tail.index("--steps") + 1] == "120" and "--model" in tail
    t = torchrun_fault_cmd(args, 3, tmp_path, python="py", kill_rank=0)
    assert t[t.index("--nproc-per-node") + 1] == "3" and t[t.index("--kill-rank") + 1] == "0"
    assert t[t.index("--ckpt-every") + 1] == "50" and t[t.index("--kill-at") + 1] == "60"
    t2 = torchrun_fault_cmd(args, 4, tmp_path, python="py")
    assert t2[t2.index("--kill-rank") + 1] == "2"  # part 2: rank PPN, as before


def test_help_exits_0() -> None:
    p = subprocess.run(
        [sys.executable, str(REPO / "bench" / "snapshots.py"), "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0, p.stderr
    assert "--quick" in p.stdout and "--fault-every" in p.stdout and "fallback" in p.stdout
