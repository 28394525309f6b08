from __future__ import annotations

from pathlib import Path

import pytest

from resild.config import Config, ConfigError, load_config


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
    p = write(tmp_path, 'heartbeat_s = 5\nprobe_interval_s = 7.5\nnode = "fromfile"\n'
                        'metrics_port = 9100\n[xid_overrides]\n43 = "degraded"\n'
                        '[probe_options.diskspace]\npaths = ["/"]\n')
    env = {"RESILD_PROBE_INTERVAL_S": "3", "RESILD_NODE": "fromenv", "RESILD_PROBES": "gpu, diskspace",
           "RESILD_KEYS": "ignored: shared namespace with the launcher"}
    cfg = load_config(p, env=env, overrides={"node": "fromcli", "metrics_port": None})
    assert cfg.heartbeat_s == 5.0 and isinstance(cfg.heartbeat_s, float)   # file
    assert cfg.probe_interval_s == 3.0                                      # env over file
    assert cfg.node == "fromcli"                                            # cli over env
    assert cfg.metrics_port == 9100                                         # None = not given
    assert cfg.probes == ["gpu", "diskspace"]
    assert cfg.xid_overrides == {"43": "degraded"}
    assert cfg.probe_options == {"diskspace": {"paths": ["/"]}}
    assert cfg.hang_timeout_s == Config().hang_timeout_s                    # default


def test_config_env_var_names_the_file(tmp_path: Path) -> None:
    p = write(tmp_path, "heartbeat_s = 9\n")
    assert load_config(None, env={"RESILD_CONFIG": str(p)}).heartbeat_s == 9.0


@pytest.mark.parametrize("text, expected", [
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
])
def test_file_errors_are_one_line_naming_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    p = write(tmp_path, text)
    with pytest.raises(ConfigError) as ei:
        load_config(p, env={})
    msg = str(ei.value)
    assert msg.startswith(f"{p}: ") and expected in msg, msg
    assert "\n" not in msg


def test_env_and_cli_errors_name_their_source(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^RESILD_HEARTBEAT_S: key 'heartbeat_s': cannot use 'soon'"):
        load_config(None, env={"RESILD_HEARTBEAT_S": "soon"})
    with pytest.raises(ConfigError, match=r"^--metrics-port: key 'metrics_port' must be an integer"):
        load_config(None, env={}, overrides={"metrics_port": "x"})
    with pytest.raises(ConfigError, match=r"^--bogus: unknown key 'bogus'"):
        load_config(None, env={}, overrides={"bogus": 1})


def test_explicit_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"absent.toml: no such file"):
        load_config(tmp_path / "absent.toml", env={})
