"""The snapshot settings: --snapshot-copies and --snapshot-every in JobSettings, what
the workers read of them from WELCOME (WorkerRedundancy), and resil-run's refusals
(pure, and resil-run through click's runner: no job is started)."""

from __future__ import annotations

import json
import math
import subprocess
from typing import Any

import pytest
from click.testing import CliRunner

import launcher.run.cli as cli
from bench.commands import resil_run as resil_run_cmd
from resild.wire.settings import (
    AUTO_COPIES,
    DEFAULT_SNAPSHOT_BUDGET,
    JobSettings,
    SettingsError,
    WorkerRedundancy,
)


def test_the_defaults_are_auto_copies_and_a_snapshot_every_commit() -> None:
    s = JobSettings()
    assert (s.snapshot_copies, s.snapshot_every) == (AUTO_COPIES, 1) == (-1, 1)
    assert s.worker_redundancy() == WorkerRedundancy()


@pytest.mark.parametrize("copies", [-1, 0, 1, 3, 8])
def test_auto_and_any_whole_number_of_copies_is_accepted(copies: int) -> None:
    assert JobSettings(snapshot_copies=copies).snapshot_copies == copies


@pytest.mark.parametrize(
    ("name", "flag", "bad"),
    [
        ("snapshot_copies", "--snapshot-copies", -2),
        ("snapshot_copies", "--snapshot-copies", True),
        ("snapshot_copies", "--snapshot-copies", False),
        ("snapshot_copies", "--snapshot-copies", 1.0),
        ("snapshot_copies", "--snapshot-copies", math.nan),
        ("snapshot_copies", "--snapshot-copies", "2"),
        ("snapshot_copies", "--snapshot-copies", None),
        ("snapshot_every", "--snapshot-every", -1),
        ("snapshot_every", "--snapshot-every", True),
        ("snapshot_every", "--snapshot-every", 2.0),
        ("snapshot_every", "--snapshot-every", "3"),
    ],
)
def test_a_bad_snapshot_setting_is_one_line_naming_the_flag_and_the_value(name: str, flag: str, bad: Any) -> None:
    with pytest.raises(SettingsError) as e:
        JobSettings(**{name: bad})
    msg = str(e.value)
    assert "\n" not in msg and flag in msg and repr(bad) in msg


def test_the_snapshot_settings_stay_whole_numbers_through_the_typed_body() -> None:
    s = JobSettings(snapshot_copies=2, snapshot_every=5)
    d = json.loads(json.dumps(s.to_dict()))
    assert (d["snapshot_copies"], d["snapshot_every"]) == (2, 5)
    back = JobSettings.from_dict(d)
    assert back == s and type(back.snapshot_copies) is int and type(back.snapshot_every) is int
    assert JobSettings.from_dict(json.loads(json.dumps(JobSettings().to_dict()))).snapshot_copies == AUTO_COPIES


@pytest.mark.parametrize(
    ("key", "bad"),
    [("snapshot_copies", 1.5), ("snapshot_every", -1), ("snapshot_copies", True), ("snapshot_budget", 0.9)],
)
def test_a_bad_snapshot_value_on_arrival_is_refused(key: str, bad: Any) -> None:
    with pytest.raises(SettingsError, match=f"--{key.replace('_', '-')}"):
        JobSettings.from_dict(dict(JobSettings().to_dict(), **{key: bad}))


def test_a_worker_reads_the_snapshot_settings_from_welcome() -> None:
    sent = JobSettings(snapshot_copies=2, snapshot_every=4).worker_redundancy()
    assert sent == WorkerRedundancy(2, 4)
    body = json.loads(json.dumps({"store": "h:1", **sent.to_dict()}))
    assert WorkerRedundancy.from_welcome(body) == sent
    assert WorkerRedundancy.from_welcome({}) == WorkerRedundancy(AUTO_COPIES, 1)  # a worker run alone
    assert WorkerRedundancy.from_welcome({"snapshot_copies": 0}) == WorkerRedundancy(0, 1)


@pytest.mark.parametrize("bad", [-2, True, False, 1.0, 1.5, "2", None, [1]])
def test_a_bad_welcome_value_is_the_default(bad: Any) -> None:
    got = WorkerRedundancy.from_welcome({"snapshot_copies": bad, "snapshot_every": bad})
    assert got == WorkerRedundancy(AUTO_COPIES, 1)


def test_a_snapshot_every_below_zero_in_welcome_is_every_commit_and_zero_is_auto() -> None:
    assert WorkerRedundancy.from_welcome({"snapshot_copies": 1, "snapshot_every": -1}) == WorkerRedundancy(1, 1)
    assert WorkerRedundancy.from_welcome({"snapshot_copies": 1, "snapshot_every": 0}) == WorkerRedundancy(1, 0)


def test_auto_cadence_and_its_budget_reach_the_workers() -> None:
    sent = JobSettings(snapshot_every=0, snapshot_budget=0.05).worker_redundancy()
    assert (sent.snapshot_every, sent.snapshot_budget) == (0, 0.05)
    assert WorkerRedundancy.from_welcome(json.loads(json.dumps(sent.to_dict()))) == sent
    for bad in (0, -0.1, 0.9, True, "0.05", None, math.inf):  # out of (0, 0.5]: the default
        assert WorkerRedundancy.from_welcome({"snapshot_budget": bad}).snapshot_budget == DEFAULT_SNAPSHOT_BUDGET


@pytest.mark.parametrize("bad", [0, -0.01, 0.51, math.nan, math.inf, True, "0.1"])
def test_a_bad_snapshot_budget_is_one_line_naming_the_flag(bad: Any) -> None:
    with pytest.raises(SettingsError) as e:
        JobSettings(snapshot_every=0, snapshot_budget=bad)
    assert "\n" not in str(e.value) and "--snapshot-budget" in str(e.value) and repr(bad) in str(e.value)


def test_a_snapshot_budget_without_auto_cadence_is_refused() -> None:
    with pytest.raises(SettingsError, match="--snapshot-budget applies to --snapshot-every auto"):
        JobSettings(snapshot_every=5, snapshot_budget=0.05)


def test_auto_copies_are_one_without_replicas_and_none_with_them_or_on_one_node() -> None:
    auto = WorkerRedundancy()
    assert auto.copies(has_replicas=False, nodes=2) == 1  # plain FSDP2, tensor parallel: snapshots
    assert auto.copies(has_replicas=True, nodes=2) == 0  # DP, DDP, HSDP: replay from a replica
    assert auto.copies(has_replicas=False, nodes=1) == 0  # no other node to hold a copy: never fail the job
    for k in (0, 1, 3):
        assert WorkerRedundancy(k).copies(False, 4) == WorkerRedundancy(k).copies(True, 4) == k


# ---- resil-run -------------------------------------------------------------------------


def resil_run(*args: str) -> Any:
    return CliRunner().invoke(cli.main, ["--local", *args, "--", "true"])


def one_error_line(output: str) -> str:
    errors = [line for line in output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, output
    assert "Traceback" not in output
    return errors[0]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--snapshot-copies", "x"), "'x' is neither a whole number nor 'auto'"),
        (("--snapshot-copies", "1.5"), "'1.5' is neither a whole number nor 'auto'"),
        (("--snapshot-copies", ""), "neither a whole number nor 'auto'"),
        (("--snapshot-copies", "-1"), "-1 is not in 0..8 (or 'auto')"),
        (("--snapshot-copies", "9"), "9 is not in 0..8"),
        (("--snapshot-every", "0"), "--snapshot-every"),
        (("--snapshot-every", "-3"), "--snapshot-every"),
        (("--snapshot-every", "2.5"), "--snapshot-every"),
        (("--snapshot-every", "sometimes"), "'sometimes' is neither a whole number nor 'auto'"),
        (("--snapshot-every", "5", "--snapshot-budget", "0.1"), "--snapshot-budget applies to --snapshot-every auto"),
        (("--snapshot-every", "auto", "--snapshot-budget", "2"), "--snapshot-budget must be a share"),
    ],
)
def test_resil_run_refuses_a_bad_snapshot_flag_in_one_line(args: tuple[str, ...], words: str) -> None:
    r = resil_run(*args)
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit)
    line = one_error_line(r.output)
    assert words in line
    if args[0] == "--snapshot-copies":
        assert "--snapshot-copies" in line


class Stop(SettingsError):
    pass


@pytest.mark.parametrize(
    ("args", "copies", "every"),
    [
        ((), AUTO_COPIES, 1),
        (("--snapshot-copies", "auto"), AUTO_COPIES, 1),
        (("--snapshot-copies", " AUTO "), AUTO_COPIES, 1),
        (("--snapshot-copies", "0"), 0, 1),
        (("--snapshot-copies", "2", "--snapshot-every", "5"), 2, 5),
        (("--snapshot-copies", "8"), 8, 1),
        (("--snapshot-every", "auto"), AUTO_COPIES, 0),
        (("--snapshot-every", " Auto "), AUTO_COPIES, 0),
    ],
)
def test_resil_run_passes_the_snapshot_flags_to_the_job_settings(
    monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], copies: int, every: int
) -> None:
    """The settings are built, then the job would start: a stand-in records them and stops there."""
    seen: list[JobSettings] = []

    def record(**kwargs: Any) -> JobSettings:
        seen.append(JobSettings(**kwargs))
        raise Stop("stopped before the job starts")

    monkeypatch.setattr(cli, "JobSettings", record)
    r = resil_run(*args)
    assert r.exit_code == 2 and "stopped before the job starts" in one_error_line(r.output)
    (s,) = seen
    assert (s.snapshot_copies, s.snapshot_every) == (copies, every)


@pytest.mark.timeout(60)
def test_resil_run_as_a_command_refuses_bad_copies_without_a_traceback() -> None:
    r = subprocess.run(
        resil_run_cmd("--snapshot-copies", "x", worker=["true"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2, r.stderr
    assert "'x' is neither a whole number nor 'auto'" in one_error_line(r.stderr)


def test_more_copies_than_other_active_nodes_is_a_usage_error_before_anything_starts() -> None:
    r = CliRunner().invoke(
        cli.main, ["--local", "--nodes", "3", "--spares", "1", "--snapshot-copies", "2", "--", "true"]
    )
    assert r.exit_code == 2, r.output
    assert "needs at least 3 active nodes" in r.output and "Traceback" not in r.output
