"""Fuzzing the config loader: any file content and any environment value either loads
into a sane Config or is ONE ConfigError line; never a traceback, never a NaN."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resild.health.config import _TYPES, Config, ConfigError, env_name, load_config

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEYS = sorted(_TYPES)
toml_values = st.sampled_from(
    [
        "nan",
        "inf",
        "-inf",
        "+nan",
        "0",
        "-1",
        "1e308",
        "1e309",
        "2.5",
        "true",
        '"x"',
        '"/tmp/s.sock"',
        '"tcp://h:1"',
        "[]",
        '["gpu"]',
        "[1]",
        "{}",
        "{a = 1}",
        "1979-05-27",
        "0x10",
        "99999999999999999999999",
    ]
) | st.text(max_size=12)


def _check(cfg: Config) -> None:
    for f in dataclasses.fields(Config):
        v = getattr(cfg, f.name)
        if _TYPES[f.name] is float:  # clock_event_hold_s 0: slowdowns count at the first read
            low_ok = v >= 0 if f.name == "clock_event_hold_s" else v > 0
            assert isinstance(v, float) and math.isfinite(v) and low_ok, (f.name, v)
    assert 0 <= cfg.metrics_port <= 65535 and cfg.node


def _load(data: bytes, env: dict[str, str] | None = None) -> None:
    with tempfile.NamedTemporaryFile(suffix=".toml") as f:
        f.write(data)
        f.flush()
        try:
            cfg = load_config(Path(f.name), env=env or {})
        except ConfigError as e:
            assert "\n" not in str(e) and str(e)
            return
    _check(cfg)


@SETTINGS
@given(st.binary(max_size=512))
def test_any_bytes(data: bytes) -> None:
    _load(data)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(KEYS) | st.text(max_size=8), toml_values), max_size=6))
def test_any_key_value_lines(pairs: list[tuple[str, str]]) -> None:
    _load("".join(f"{k} = {v}\n" for k, v in pairs).encode("utf-8", "surrogatepass"))


@SETTINGS
@given(
    st.dictionaries(
        st.sampled_from(KEYS),
        st.text(max_size=20) | st.sampled_from(["nan", "inf", "1e999", "-0", "3", "a=b", "79=failed"]),
        max_size=4,
    )
)
def test_any_environment(values: dict[str, str]) -> None:
    env = {env_name(k): v for k, v in values.items() if "\x00" not in v}
    _load(b"", env)
