"""The node process's command line as every starter builds it (launcher.node.command):
the flags it writes are the ones `python -m launcher.node` parses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launcher.node.command import node_command
from resild.wire.settings import JobSettings

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]


def test_the_worker_command_follows_the_separator_and_the_settings_round_trip() -> None:
    s = JobSettings()
    argv = node_command("tcp://127.0.0.1:5555", 2, s.to_dict(), ["python", "train.py", "--steps", "3"], node="n0")
    assert argv[1:3] == ["-m", "launcher.node"]
    assert argv[argv.index("--") + 1 :] == ["python", "train.py", "--steps", "3"]
    assert JobSettings.from_dict(json.loads(argv[argv.index("--settings") + 1])) == s
    # Under Slurm the node is $SLURMD_NODENAME: no --node at all
    assert "--node" not in node_command("tcp://h:1", 1, s.to_dict(), ["x"], keys="/k")


def test_every_flag_it_writes_is_one_the_node_process_parses(tmp_path: Path) -> None:
    argv = node_command(
        "tcp://127.0.0.1:1",
        1,
        JobSettings().to_dict(),
        [],  # no worker command: the node process stops at that check, after parsing every flag
        node="n0",
        keys=tmp_path,
        qualify=True,
        nvml_control=tmp_path / "nvml.json",
        python=sys.executable,
    )
    r = subprocess.run(argv, capture_output=True, text=True, timeout=50, cwd=REPO)
    assert r.returncode == 2 and "no worker command given after --" in r.stderr, r.stderr
