from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from resild.health.fakenvml import build_fake_nvml, fake_nvml_env

SCENARIO = Path(__file__).with_name("probe_scenario.py")
REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake libnvidia-ml.so.1, compiled once per session."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml"))


@pytest.fixture(scope="session")
def old_fake_nvml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake library without the functions an old driver lacks."""
    return build_fake_nvml(tmp_path_factory.mktemp("fake_nvml_old"), old_driver=True)


ScenarioRunner = Callable[..., dict[str, Any]]


@pytest.fixture
def run_scenario(fake_nvml_dir: Path, tmp_path: Path) -> ScenarioRunner:
    """Runs probe_scenario.py in a child with the fake library; returns its JSON."""

    def run(
        control: list[str], steps: list[dict], *, lib_dir: Path | None = None, timeout_s: float = 20.0
    ) -> dict[str, Any]:
        ctl = tmp_path / "nvml.ctl"
        ctl.write_text("".join(line + "\n" for line in control))
        env = fake_nvml_env(lib_dir or fake_nvml_dir, ctl)
        env["PYTHONPATH"] = str(REPO) + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = subprocess.run(
            [sys.executable, str(SCENARIO), json.dumps(steps)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=tmp_path,
        )
        assert proc.returncode == 0, f"scenario failed:\n{proc.stdout}\n{proc.stderr}"
        return json.loads(proc.stdout.strip().splitlines()[-1])

    return run
