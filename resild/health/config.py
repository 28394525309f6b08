"""Node-agent configuration: defaults < TOML file < RESILD_CFG_* environment < command line.

Every layer is checked the same way: an unknown key or a value of the wrong
type is a ConfigError whose message is ONE line naming the source and the key,
e.g. ``/etc/resild/resild.toml: unknown key 'hearbeat_s' (did you mean 'heartbeat_s'?)``.
A config that silently ignores a typo is how health checks end up failing open.

Configuration keys have their own environment prefix, RESILD_CFG_<KEY> (e.g.
RESILD_CFG_PROBE_INTERVAL_S), apart from the variables the launcher sets for its
workers (RESILD_NODE, RESILD_KEYS, ...: resild.wire.env lists them all), so an
unknown RESILD_CFG_* variable is an error like an unknown key in the file.
"""

from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import socket
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resild.health.xid import validate_overrides
from resild.wire.env import CFG_PREFIX, CONFIG

DEFAULT_CONFIG_PATH = Path("/etc/resild/resild.toml")
DEFAULT_PROBES = ("gpu", "kmsg")


class ConfigError(ValueError):
    """A bad configuration; str() is one line: '<source>: <what is wrong>'."""

    def __init__(self, source: str, message: str) -> None:
        super().__init__(f"{source}: {message}")
        self.source = source


@dataclass
class Config:
    controller: str = ""  # controller endpoint; "" = standalone
    keys_dir: str = ""  # CURVE key dir (resild keys DIR); "" = no CURVE
    node: str = field(default_factory=socket.gethostname)
    heartbeat_s: float = 2.0
    probe_interval_s: float = 10.0
    probe_timeout_s: float = 10.0  # a probe slower than this counts as FAILED
    nvml_call_timeout_s: float = 2.0
    # Hardware clock slowdowns degrade a GPU once they held this long (most of the polls).
    clock_event_hold_s: float = 30.0
    # A watched process without progress this long is hung. (Not the job's --hang-timeout, which
    # the controller applies to a whole job; this was `hang_timeout_s` before 0.2.)
    stall_timeout_s: float = 300.0
    metrics_port: int = 0  # 0 = no Prometheus endpoint
    metrics_addr: str = "127.0.0.1"
    metrics_public: bool = False  # metrics_addr beyond loopback must be asked for by name
    kmsg_path: str = "/dev/kmsg"
    state_dir: str = "/var/lib/resild"
    status_socket: str = "/run/resild/status.sock"
    status_timeout_s: float = 3.0  # `resild status` waits this long for the daemon
    status_group: str = "resild"  # the status socket is 0660 in this group ("" = any local user)
    xid_overrides: dict[str, str] = field(default_factory=dict)  # {"43": "degraded"}
    probes: list[str] = field(default_factory=lambda: list(DEFAULT_PROBES))
    probe_options: dict[str, dict[str, Any]] = field(default_factory=dict)  # per probe name

    @property
    def status_endpoint(self) -> str:
        s = self.status_socket
        return s if "://" in s else f"ipc://{s}"


_FIELDS = {f.name: f for f in dataclasses.fields(Config)}
_TYPES: dict[str, type] = {
    "controller": str,
    "keys_dir": str,
    "node": str,
    "heartbeat_s": float,
    "probe_interval_s": float,
    "probe_timeout_s": float,
    "nvml_call_timeout_s": float,
    "clock_event_hold_s": float,
    "stall_timeout_s": float,
    "metrics_port": int,
    "metrics_addr": str,
    "metrics_public": bool,
    "kmsg_path": str,
    "state_dir": str,
    "status_socket": str,
    "status_timeout_s": float,
    "status_group": str,
    "xid_overrides": dict,
    "probes": list,
    "probe_options": dict,
}
assert set(_TYPES) == set(_FIELDS), "every Config field needs a declared type"
_TYPE_NAMES = {
    str: "a string",
    float: "a number",
    int: "an integer",
    bool: "true or false",
    dict: "a table",
    list: "a list of strings",
}
_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
MAX_STATUS_TIMEOUT_S = 3600.0  # beyond this a timeout is a typo (1e308 overflowed the socket's)
MAX_STALL_TIMEOUT_S = 7 * 86400.0  # a watched process silent for a week is hung by any standard


def env_name(key: str) -> str:
    return CFG_PREFIX + key.upper()


_RENAMED = {"hang_timeout_s": "stall_timeout_s"}


def _unknown(source: str, key: str) -> ConfigError:
    if key in _RENAMED:
        return ConfigError(source, f"key '{key}' is now '{_RENAMED[key]}' (the job's hang timeout is resil-run's)")
    close = difflib.get_close_matches(key, list(_FIELDS), n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return ConfigError(source, f"unknown key '{key}'{hint}")


def _check_type(source: str, key: str, value: Any) -> Any:
    want = _TYPES[key]
    ok = False
    if want is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        if ok:
            try:
                value = float(value)
            except OverflowError:  # an integer too big for a float
                ok = False
        if ok and not math.isfinite(value):
            raise ConfigError(source, f"key '{key}' must be a finite number, not {value!r}")
    elif want is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif want is bool:
        ok = isinstance(value, bool)
    elif want is list:
        ok = isinstance(value, list) and all(isinstance(v, str) for v in value)
    else:
        ok = isinstance(value, want)
    if not ok:
        raise ConfigError(source, f"key '{key}' must be {_TYPE_NAMES[want]}, not {type(value).__name__} {value!r}")
    return value


def _parse_env(source: str, key: str, text: str) -> Any:
    """One environment value as the field's type (lists comma-separated, tables k=v,k=v)."""
    want = _TYPES[key]
    try:
        if want is float:
            v = float(text)
            if not math.isfinite(v):
                raise ValueError("not a finite number")
            return v
        if want is int:
            return int(text)
        if want is bool:
            if text.strip().lower() not in _BOOL_WORDS:
                raise ValueError("expected true or false")
            return _BOOL_WORDS[text.strip().lower()]
        if want is list:
            return [p.strip() for p in text.split(",") if p.strip()]
        if want is dict:
            if key != "xid_overrides":
                raise ValueError("only settable in the TOML file")
            pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
            if any(len(p) != 2 for p in pairs):
                raise ValueError("expected CODE=CLASS[,CODE=CLASS...]")
            return {k.strip(): v.strip() for k, v in pairs}
    except ValueError as e:
        raise ConfigError(source, f"key '{key}': cannot use {text!r}: {e}") from None
    return text


def _validate(source: str, cfg: Config) -> None:
    for key in (
        "heartbeat_s",
        "probe_interval_s",
        "probe_timeout_s",
        "nvml_call_timeout_s",
        "stall_timeout_s",
        "status_timeout_s",
    ):
        if getattr(cfg, key) <= 0:
            raise ConfigError(source, f"key '{key}' must be > 0, not {getattr(cfg, key)!r}")
        most = MAX_STALL_TIMEOUT_S if key == "stall_timeout_s" else MAX_STATUS_TIMEOUT_S
        if getattr(cfg, key) > most:  # 1e308 passed, then overflowed a socket or thread timeout
            raise ConfigError(source, f"key '{key}' must be at most {most:g} seconds, not {getattr(cfg, key):g}")
    if not 0 <= cfg.clock_event_hold_s <= MAX_STATUS_TIMEOUT_S:  # NaN fails too
        raise ConfigError(
            source,
            f"key 'clock_event_hold_s' must be 0..{MAX_STATUS_TIMEOUT_S:g} seconds, not {cfg.clock_event_hold_s!r}",
        )
    if cfg.status_timeout_s > MAX_STATUS_TIMEOUT_S:
        raise ConfigError(
            source, f"key 'status_timeout_s' must be at most {MAX_STATUS_TIMEOUT_S:g}, not {cfg.status_timeout_s:g}"
        )
    if not 0 <= cfg.metrics_port <= 65535:
        raise ConfigError(source, f"key 'metrics_port' must be 0..65535, not {cfg.metrics_port}")
    if not cfg.node:
        raise ConfigError(source, "key 'node' must not be empty")
    if "://" in cfg.status_socket and not cfg.status_socket.startswith("ipc://"):
        raise ConfigError(
            source, f"key 'status_socket' must be a path (a local unix socket), not {cfg.status_socket!r}"
        )
    try:
        validate_overrides(cfg.xid_overrides)
    except ValueError as e:
        raise ConfigError(source, f"key 'xid_overrides': {e}") from None
    for name, opts in cfg.probe_options.items():
        if not isinstance(opts, dict):
            raise ConfigError(source, f"key 'probe_options.{name}' must be a table")


def is_loopback(addr: str) -> bool:
    """Loopback by its literal form only: a host name other than localhost is not resolved
    (it could name a public interface), and "" means every interface."""
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


def _check_metrics_public(cfg: Config, sources: Mapping[str, str]) -> None:
    """After every source: the opt-in may come from another source than the address."""
    if not cfg.metrics_public and not is_loopback(cfg.metrics_addr):
        raise ConfigError(
            sources.get("metrics_addr", "config"),
            f"key 'metrics_addr' is {cfg.metrics_addr!r}, not loopback: metrics would be served "
            "to the network; set 'metrics_public = true' to mean it",
        )


def _apply(cfg: Config, source: str, values: Mapping[str, Any], sources: dict[str, str] | None = None) -> None:
    for key, value in values.items():
        if key not in _FIELDS:
            raise _unknown(source, key)
        setattr(cfg, key, _check_type(source, key, value))
        if sources is not None:
            sources[key] = source
    _validate(source, cfg)


def load_config(
    path: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the config. ``path=None`` reads DEFAULT_CONFIG_PATH if it exists
    (RESILD_CONFIG names another); an explicit path must exist.
    ``overrides``: command-line values (None entries are ignored)."""
    env = os.environ if env is None else env
    cfg = Config()
    sources: dict[str, str] = {}  # key -> where its value came from, for error messages
    explicit = path is not None or CONFIG.name in env
    file = Path(path if path is not None else env.get(CONFIG.name, DEFAULT_CONFIG_PATH))
    source = str(file)
    if explicit or file.exists():
        try:
            with open(file, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(source, "no such file") from None
        except OSError as e:
            raise ConfigError(source, f"cannot read: {e.strerror or e}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(source, f"not valid TOML: {str(e).splitlines()[0] if str(e) else e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(source, f"not UTF-8 text (byte {e.start}): TOML files must be UTF-8") from None
        except (ValueError, RecursionError) as e:  # tomllib's own limits, e.g. deep nesting
            raise ConfigError(source, f"not valid TOML: {str(e)[:200]}") from None
        _apply(cfg, source, data, sources)
    for name in env:
        if name.startswith(CFG_PREFIX) and name[len(CFG_PREFIX) :].lower() not in _FIELDS:
            raise _unknown(name, name[len(CFG_PREFIX) :].lower())
    env_values = {key: _parse_env(env_name(key), key, env[env_name(key)]) for key in _FIELDS if env_name(key) in env}
    for key, value in env_values.items():
        _apply(cfg, env_name(key), {key: value}, sources)
    cli = {k: v for k, v in (overrides or {}).items() if v is not None}
    for key, value in cli.items():
        _apply(cfg, f"--{key.replace('_', '-')}", {key: value}, sources)
    _check_metrics_public(cfg, sources)
    return cfg
