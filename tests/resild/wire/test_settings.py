"""The job's settings: one validated object, the nesting enforced at construction,
derived values computed once (pure: no sockets, no processes)."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess

import pytest

from bench.commands import resil_run
from resild.wire.settings import MIN_COLLECTIVE_TIMEOUT_S, JobSettings, SettingsError, WorkerTimeouts


def test_defaults_nest() -> None:
    s = JobSettings()
    assert s.heartbeat_interval_s < s.heartbeat_timeout_s < s.controller_timeout_s < s.collective_timeout_s


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"heartbeat_timeout_s": 10, "controller_timeout_s": 1}, ("--heartbeat-timeout 10", "--controller-timeout 1")),
        ({"heartbeat_timeout_s": 5, "controller_timeout_s": 5}, ("--heartbeat-timeout 5", "--controller-timeout 5")),
        ({"heartbeat_interval_s": 3.0}, ("heartbeat interval 3", "--heartbeat-timeout 2")),
        ({"controller_timeout_s": 90}, ("--controller-timeout 90", "--hang-timeout 10")),
    ],
)
def test_a_bad_nesting_is_one_line_naming_both_settings(kwargs: dict, names: tuple[str, str]) -> None:
    with pytest.raises(SettingsError) as e:
        JobSettings(**kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    for n in names:
        assert n in msg


def test_a_longer_hang_timeout_makes_room_for_a_longer_controller_timeout() -> None:
    s = JobSettings(controller_timeout_s=90, hang_timeout_s=31)
    assert s.collective_timeout_s == 93 > 90


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, "5", True, None])
def test_every_value_is_a_finite_non_negative_number(bad: object) -> None:
    with pytest.raises(SettingsError, match="--hang-timeout"):
        JobSettings(hang_timeout_s=bad)  # type: ignore[arg-type]


def test_no_controller_timeout_means_no_leases_and_no_nesting_with_it() -> None:
    s = JobSettings(heartbeat_timeout_s=30, controller_timeout_s=0)
    d = s.for_nodes(4)
    assert d.lease_interval_s == 0 and d.lease_timeout_s == 0


def test_derived_values_at_small_scale_are_the_settings() -> None:
    s = JobSettings()
    d = s.for_nodes(4)
    assert d.heartbeat_interval_s == s.heartbeat_interval_s
    assert d.heartbeat_timeout_s == s.heartbeat_timeout_s
    assert d.lease_interval_s == s.controller_timeout_s / 4
    assert d.lease_timeout_s == s.controller_timeout_s


def test_at_scale_heartbeats_leases_and_waits_stretch_together() -> None:
    """2,000 nodes on a 2,000/s budget: heartbeats every 1 s, a node lost after 4 s, leases
    every 4 s and a node waits 12 s for one; the nesting still holds."""
    d = JobSettings().for_nodes(2000)
    assert (d.heartbeat_interval_s, d.heartbeat_timeout_s, d.lease_interval_s, d.lease_timeout_s) == (1, 4, 4, 12)
    assert d.heartbeat_interval_s < d.heartbeat_timeout_s < d.lease_timeout_s


def test_worker_timeouts_follow_the_hang_timeout() -> None:
    w = JobSettings(hang_timeout_s=40).worker_timeouts()
    assert w.collective_timeout_s == 120
    assert w.wait_report_s == 1.0
    assert w.notice_timeout_s > w.collective_timeout_s
    assert JobSettings().worker_timeouts().collective_timeout_s == MIN_COLLECTIVE_TIMEOUT_S


def test_a_worker_reads_its_timeouts_from_welcome_and_defaults_from_the_one_owner() -> None:
    sent = JobSettings(hang_timeout_s=40).worker_timeouts()
    assert WorkerTimeouts.from_welcome(json.loads(json.dumps({"store": "h:1", **sent.to_dict()}))) == sent
    alone = WorkerTimeouts.from_welcome({})  # no controller: JobSettings' defaults
    assert alone == JobSettings().worker_timeouts()
    bad = WorkerTimeouts.from_welcome({"collective_timeout_s": "soon", "wait_report_s": -1, "notice_timeout_s": True})
    assert bad == alone


def test_the_typed_body_round_trips_and_is_validated_on_arrival() -> None:
    s = JobSettings(hang_timeout_s=12.5, controller_timeout_s=7)
    assert JobSettings.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    bad = dict(s.to_dict(), controller_timeout_s=1, heartbeat_timeout_s=10)
    with pytest.raises(SettingsError, match="--controller-timeout 1"):
        JobSettings.from_dict(bad)
    with pytest.raises(SettingsError, match="unknown job setting"):
        JobSettings.from_dict(dict(s.to_dict(), hang_timout_s=1))
    with pytest.raises(SettingsError, match="lack: hang_timeout_s"):
        JobSettings.from_dict({k: v for k, v in s.to_dict().items() if k != "hang_timeout_s"})
    with pytest.raises(SettingsError):
        JobSettings.from_dict([1, 2])


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        JobSettings().hang_timeout_s = 1  # type: ignore[misc]


@pytest.mark.timeout(60)
def test_resil_run_refuses_a_bad_nesting_in_one_line() -> None:
    r = subprocess.run(
        resil_run("--heartbeat-timeout", "10", "--controller-timeout", "1", worker=["true"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2
    err = [line for line in r.stderr.splitlines() if line.startswith("Error:")]
    assert len(err) == 1, r.stderr
    assert "--heartbeat-timeout 10" in err[0] and "--controller-timeout 1" in err[0]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "kwargs,said",
    [
        ({"hang_timeout_s": 1e14}, "--hang-timeout must be at most 86400 seconds, not 1e+14"),
        ({"hang_timeout_s": 1e308}, "--hang-timeout must be at most 86400 seconds"),
        ({"start_timeout_s": 1e9}, "--start-timeout must be at most 86400 seconds"),
        ({"snapshot_every": 10**21}, "--snapshot-every must be at most 1,000,000"),
        ({"fingerprint_every": 10**20}, "--fingerprint-every must be at most 1,000,000"),
        ({"straggler_window": 10**7}, "--straggler-window must be at most 1,000,000"),
    ],
)
def test_every_duration_and_count_has_an_upper_bound_said_in_one_line(kwargs: dict, said: str) -> None:
    """Accepted before, these hung a job with no error (issue 39, finding 10)."""
    with pytest.raises(SettingsError) as e:
        JobSettings(**kwargs)
    assert said in str(e.value) and "\n" not in str(e.value)
    JobSettings(**{k: (86400.0 if isinstance(v, float) else 10**6) for k, v in kwargs.items()})  # the bound itself


@pytest.mark.timeout(60)
def test_resil_run_refuses_a_huge_hang_timeout_in_one_line() -> None:
    r = subprocess.run(resil_run("--hang-timeout", "1e14", worker=["true"]), capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert [line for line in r.stderr.splitlines() if line.startswith("Error:")] == [
        "Error: --hang-timeout must be at most 86400 seconds, not 1e+14"
    ], r.stderr
