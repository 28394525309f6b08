"""`resild report`: table, --json, --plot PNG/HTML, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from resild.cli import cli
from tests.resild.report.test_goodput import one_failure_job

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def events_file(tmp_path: Path) -> Path:
    p = tmp_path / "run.jsonl"
    p.write_text("".join(json.dumps(e) + "\n" for e in one_failure_job()))
    return p


def run(*args: str):
    return CliRunner().invoke(cli, ["report", *args])


def test_table(events_file: Path):
    r = run(str(events_file))
    assert r.exit_code == 0, r.output
    assert "productive steps" in r.output and "54.6%" in r.output and "kill:n1@40" in r.output


def test_json_is_machine_readable(events_file: Path):
    r = run(str(events_file), "--json")
    d = json.loads(r.stdout)
    assert d["goodput"] == pytest.approx(13.93 / 25.5)
    assert d["failures"][0]["recovery_s"] == pytest.approx(0.6)


def test_plot_png_and_html(events_file: Path, tmp_path: Path):
    png, page = tmp_path / "t.png", tmp_path / "t.html"
    assert run(str(events_file), "--plot", str(png)).exit_code == 0
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    assert run(str(events_file), "--plot", str(page)).exit_code == 0
    text = page.read_text()
    assert "data:image/png;base64," in text and "where the time went" in text and "kill:n1@40" in text


@pytest.mark.parametrize(
    "content,msg",
    [
        (None, "no such file"),
        ("", "empty (no events)"),
        ("{not json\n", "not JSON"),
        ('{"no": "event"}\n', "not a resild event"),
    ],
)
def test_errors_are_one_line_no_traceback(tmp_path: Path, content: str | None, msg: str):
    p = tmp_path / "e.jsonl"
    if content is not None:
        p.write_text(content)
    r = subprocess.run(
        [sys.executable, "-m", "resild.cli", "report", str(p)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2
    assert msg in r.stderr and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bad_plot_suffix(events_file: Path, tmp_path: Path):
    r = run(str(events_file), "--plot", str(tmp_path / "x.pdf"))
    assert r.exit_code == 2 and "must end in .png or .html" in r.output
