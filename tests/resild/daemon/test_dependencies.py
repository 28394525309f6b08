"""The node daemon installs with its own few dependencies: nothing it runs imports torch,
plotting, etcd or the launcher (those are extras: launcher, standby, report)."""

from __future__ import annotations

import subprocess
import sys

import pytest

# A meta-path finder that refuses the extras' packages, so an import of one fails loudly.
BLOCK = """
import sys
EXTRAS = {"torch", "torchdata", "matplotlib", "etcd3gw", "cryptography", "numpy", "launcher"}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in EXTRAS:
            raise ImportError(f"{name} is not a node-daemon dependency")
sys.meta_path.insert(0, Block())
"""


@pytest.mark.timeout(60)
def test_the_daemon_and_its_cli_import_without_the_extras() -> None:
    code = BLOCK + (
        "import resild.cli, resild.daemon.agent, resild.health.config, resild.daemon.metrics, resild.health.probes\n"
        "import resild.health.nvml_probe, resild.health.kmsg, resild.slurm, resild.report.goodput\n"
        "from click.testing import CliRunner\n"
        "r = CliRunner().invoke(resild.cli.cli, ['status', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


@pytest.mark.timeout(60)
def test_the_block_catches_an_extra() -> None:
    """The check above can fail: importing the standby replica needs etcd3gw."""
    r = subprocess.run(
        [sys.executable, "-c", BLOCK + "import resild.controller.replica\n"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode != 0 and "not a node-daemon dependency" in r.stderr
