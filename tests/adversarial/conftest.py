"""Shared fixtures of the adversarial suite."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def public_dir() -> Iterator[Path]:
    """A directory other users can traverse (pytest's tmp_path is under a 0700 one)."""
    d = Path(tempfile.mkdtemp(prefix="resild-adv-", dir="/tmp"))
    os.chmod(d, 0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)
