"""`resild report` on hostile files: each ends at once with a one-line error, never a
traceback, a hang or a wrong total."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resild.report.goodput import EventFileError, analyze, format_breakdown, load_events

pytestmark = pytest.mark.timeout(60)
GOOD = '{"event":"job_started","t_mono":1.0}\n'


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero")
def test_dev_zero_is_refused_not_read_forever() -> None:
    with pytest.raises(EventFileError, match="line over"):
        load_events("/dev/zero")


def test_deep_nesting_is_a_one_line_error(tmp_path: Path) -> None:
    p = tmp_path / "deep.jsonl"
    p.write_text(GOOD + '{"event":"x","t_mono":2,"f":' + "[" * 200_000 + "]" * 200_000 + "}\n")
    with pytest.raises(EventFileError, match=r":2: .*nested"):
        load_events(p)


@pytest.mark.parametrize("bad", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused_naming_the_line(tmp_path: Path, bad: str) -> None:
    p = tmp_path / "nan.jsonl"
    p.write_text(GOOD + f'{{"event":"job_finished","t_mono":{bad},"train_s":1}}\n')
    with pytest.raises(EventFileError, match=rf":2: .*{bad}"):
        load_events(p)


def test_the_cli_says_one_line(tmp_path: Path) -> None:
    p = tmp_path / "deep.jsonl"
    p.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    r = subprocess.run(
        [sys.executable, "-m", "resild.cli", "report", str(p)], capture_output=True, text=True, timeout=30
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ---- a fuzzer: the demo's real events with hostile values in their fields (issue 39, finding 11) ----
DEMO = [
    json.loads(line) for line in (Path(__file__).parents[2] / "docs" / "demo-events.jsonl").read_text().splitlines()
]
KEYS = sorted({k for e in DEMO for k in e} | {"t_log", "layout", "step"})
HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**400), max_value=10**400),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["nan", "inf", "1e999", "x", "", "1.0"]),
    st.lists(st.integers(min_value=-3, max_value=3), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(min_value=-3, max_value=3), max_size=2),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(DEMO) - 1), st.sampled_from(KEYS), HOSTILE), min_size=1, max_size=3))
def test_any_field_of_any_event_holding_anything_is_a_report_or_a_one_line_error(
    edits: list[tuple[int, str, object]],
) -> None:
    """A bad t_log, a 400-digit number, `layout: 5`, a "nan" string: printed a traceback before."""
    events = [dict(e) for e in DEMO]
    for i, key, value in edits:
        events[i][key] = value
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "run.jsonl"
        p.write_text("".join(json.dumps(e) + "\n" for e in events))
        try:
            b = analyze(load_events(p))
        except EventFileError as e:
            assert "\n" not in str(e) and str(e)
            return
        format_breakdown(b)
        json.dumps(b.to_dict())
