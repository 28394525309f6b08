"""`resild report` on hostile files: each ends at once with a one-line error, never a
traceback, a hang or a wrong total."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from resild.report.goodput import EventFileError, load_events

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
