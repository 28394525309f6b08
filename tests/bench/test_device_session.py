"""bench/device_session.sh, the prepared device lease: it parses, and teaches its use."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(30)
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "device_session.sh"


def test_the_script_parses_and_names_its_steps_when_called_without_one(tmp_path: Path) -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0
    p = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}
    )
    assert p.returncode == 2 and "prepare|gpu|cores" in p.stderr
