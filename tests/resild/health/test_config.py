from __future__ import annotations

from pathlib import Path

import pytest

from bench.commands import resil_run
from resild.health.config import Config, ConfigError, load_config


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "resild.toml"
    p.write_text(text)
    return p


@pytest.mark.skipif(Path("/etc/resild/resild.toml").exists(), reason="a real config is installed")
def test_defaults_without_file(tmp_path: Path) -> None:
    cfg = load_config(None, env={"RESILD_CONFIG_UNUSED": "x"})  # default path absent here
    assert cfg == Config(node=cfg.node)
    assert cfg.status_endpoint == "ipc:///run/resild/status.sock"
    assert cfg.probes == ["gpu", "kmsg"]


def test_precedence_defaults_file_env_cli(tmp_path: Path) -> None:
    p = write(
        tmp_path,
        'heartbeat_s = 5\nprobe_interval_s = 7.5\nnode = "fromfile"\n'
        'metrics_port = 9100\n[xid_overrides]\n43 = "degraded"\n'
        '[probe_options.diskspace]\npaths = ["/"]\n',
    )
    env = {
        "RESILD_CFG_PROBE_INTERVAL_S": "3",
        "RESILD_CFG_NODE": "fromenv",
        "RESILD_CFG_PROBES": "gpu, diskspace",
        "RESILD_NODE": "ignored: the launcher's variable for its workers, not a config key",
        "RESILD_KEYS": "ignored: the launcher's",
    }
    cfg = load_config(p, env=env, overrides={"node": "fromcli", "metrics_port": None})
    assert cfg.heartbeat_s == 5.0 and isinstance(cfg.heartbeat_s, float)  # file
    assert cfg.probe_interval_s == 3.0  # env over file
    assert cfg.node == "fromcli"  # cli over env
    assert cfg.metrics_port == 9100  # None = not given
    assert cfg.probes == ["gpu", "diskspace"]
    assert cfg.xid_overrides == {"43": "degraded"}
    assert cfg.probe_options == {"diskspace": {"paths": ["/"]}}
    assert cfg.stall_timeout_s == Config().stall_timeout_s  # default


def test_config_env_var_names_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, "heartbeat_s = 9\n")
    assert load_config(None, env={"RESILD_CONFIG": str(p)}).heartbeat_s == 9.0


@pytest.mark.parametrize(
    "text, expected",
    [
        ("hearbeat_s = 1\n", "unknown key 'hearbeat_s' (did you mean 'heartbeat_s'?)"),
        ("zzz = 1\n", "unknown key 'zzz'"),
        ('heartbeat_s = "fast"\n', "key 'heartbeat_s' must be a number, not str 'fast'"),
        ("metrics_port = 1.5\n", "key 'metrics_port' must be an integer"),
        ("metrics_port = true\n", "key 'metrics_port' must be an integer"),
        ("probes = [1, 2]\n", "key 'probes' must be a list of strings"),
        ("heartbeat_s = 0\n", "key 'heartbeat_s' must be > 0"),
        ("metrics_port = 70000\n", "key 'metrics_port' must be 0..65535"),
        ('[xid_overrides]\n79 = "fatal"\n', "key 'xid_overrides': invalid Xid override for Xid 79"),
        ("heartbeat_s = \n", "not valid TOML"),
    ],
)
def test_file_errors_are_one_line_naming_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={})
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and expected in msg, msg
    assert "\n" not in msg


def test_env_and_cli_errors_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^RESILD_CFG_HEARTBEAT_S: key 'heartbeat_s': cannot use 'soon'"):
        load_config(None, env={"RESILD_CFG_HEARTBEAT_S": "soon"})
    with pytest.raises(ConfigError, match=r"^--metrics-port: key 'metrics_port' must be an integer"):
        load_config(None, env={}, overrides={"metrics_port": "x"})
    with pytest.raises(ConfigError, match=r"^--bogus: unknown key 'bogus'"):
        load_config(None, env={}, overrides={"bogus": 1})


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent.toml: no such file"):
        load_config(tmp_path / "absent.toml", env={})


@pytest.mark.parametrize(
    "text", ["status_timeout_s = nan\n", "heartbeat_s = inf\n", "stall_timeout_s = -inf\n", "probe_timeout_s = +nan\n"]
)
def test_non_finite_floats_are_refused(tmp_path: Path, text: str) -> None:
    """`status_timeout_s = nan` was accepted and then crashed `resild status`."""
    with pytest.raises(ConfigError, match="must be a finite number") as ei:
        load_config(write(tmp_path, text), env={})
    assert "\n" not in str(ei.value)


@pytest.mark.parametrize("value", ["nan", "inf", "-Infinity", "1e999"])
def test_non_finite_env_values_are_refused(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^RESILD_CFG_STATUS_TIMEOUT_S: key 'status_timeout_s'"):
        load_config(None, env={"RESILD_CFG_STATUS_TIMEOUT_S": value, "RESILD_CONFIG": "/dev/null"})


def test_non_utf8_file_is_one_line(tmp_path: Path) -> None:
    p = tmp_path / "resild.toml"
    p.write_bytes(b'node = "caf\xe9"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={})
    assert str(ei.value).startswith(f"{p}: not UTF-8") and "\n" not in str(ei.value)


def test_non_utf8_file_from_the_cli_prints_no_traceback(tmp_path: Path) -> None:
    import subprocess
    import sys

    p = tmp_path / "resild.toml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    out = subprocess.run(
        [sys.executable, "-m", "resild.cli", "status", "--config", str(p)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "not UTF-8" in out.stderr


def test_status_socket_must_be_local() -> None:
    with pytest.raises(ConfigError, match="status_socket"):
        load_config(None, env={"RESILD_CONFIG": "/dev/null"}, overrides={"status_socket": "tcp://0.0.0.0:5"})


@pytest.mark.timeout(120)
def test_resil_run_start_timeout_flag(tmp_path: Path) -> None:
    """The start timeout (300 s) is a flag: workers that never register fail the job in time."""
    import subprocess
    import sys
    import time

    t0 = time.monotonic()
    out = subprocess.run(
        resil_run(
            "-q",
            "--start-timeout",
            "2",
            "--run-dir",
            str(tmp_path / "run"),
            nodes=2,
            spares=0,
            worker=[sys.executable, "-c", "import time; time.sleep(60)"],
        ),
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert out.returncode == 1 and "start timed out after 2s" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 60
    bad = subprocess.run(
        resil_run("--start-timeout", "nan", worker=["true"]),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_an_unknown_config_variable_is_an_error_naming_it() -> None:
    with pytest.raises(
        ConfigError, match=r"^RESILD_CFG_HEARTBAET_S: unknown key 'heartbaet_s' \(did you mean 'heartbeat_s'\?\)"
    ):
        load_config(None, env={"RESILD_CFG_HEARTBAET_S": "1", "RESILD_CONFIG": "/dev/null"})


def test_the_renamed_stall_timeout_says_its_new_name(tmp_path: Path) -> None:
    p = write(tmp_path, "hang_timeout_s = 60\n")
    with pytest.raises(ConfigError, match=r"key 'hang_timeout_s' is now 'stall_timeout_s'"):
        load_config(p, env={})


@pytest.mark.parametrize("addr", ["0.0.0.0", "::", "10.1.2.3", "node17"])
def test_a_public_metrics_address_needs_an_explicit_opt_in(tmp_path: Path, addr: str) -> None:
    p = write(tmp_path, f'metrics_port = 9400\nmetrics_addr = "{addr}"\n')
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={})
    msg = str(ei.value)
    assert "\n" not in msg and "metrics_public" in msg and "metrics_addr" in msg
    p.write_text(f'metrics_port = 9400\nmetrics_addr = "{addr}"\nmetrics_public = true\n')
    assert load_config(p, env={}).metrics_addr == addr
    # The opt-in may come from another source than the address.
    p.write_text(f'metrics_addr = "{addr}"\n')
    assert load_config(p, env={"RESILD_CFG_METRICS_PUBLIC": "true"}).metrics_public


@pytest.mark.parametrize("addr", ["127.0.0.1", "127.0.0.53", "::1", "localhost"])
def test_loopback_metrics_addresses_need_no_opt_in(tmp_path: Path, addr: str) -> None:
    p = write(tmp_path, f'metrics_addr = "{addr}"\n')
    assert load_config(p, env={}).metrics_addr == addr


@pytest.mark.parametrize("value", [1e308, 3601.0, 0.0, -1.0])
def test_an_absurd_status_timeout_is_refused(value: float) -> None:
    with pytest.raises(ConfigError, match="status_timeout_s"):
        load_config(None, env={}, overrides={"status_timeout_s": value})


@pytest.mark.parametrize(
    "key", ["heartbeat_s", "probe_interval_s", "probe_timeout_s", "nvml_call_timeout_s", "stall_timeout_s"]
)
def test_every_duration_has_an_upper_bound(key: str) -> None:
    """probe_timeout_s = 1e308 passed, then `resild check` died of an OverflowError (issue 39, finding 12)."""
    with pytest.raises(ConfigError, match=f"key '{key}' must be at most"):
        load_config(None, env={}, overrides={key: 1e308})
    load_config(None, env={}, overrides={key: 3600.0})
