"""The verdict reaches resil-run even when the run directory's disk is full."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest

from resild.controller import verdict_file
from resild.controller.verdict_file import RESERVE_BYTES, RESULT_FILE


def test_a_verdict_is_written_through_its_reserved_blocks_when_nothing_else_can_be(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verdict_file.reserve(tmp_path, 1)

    def full(self: Path, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)
    verdict_file.write(tmp_path, 1, 0, "all 4 ranks finished")
    assert json.loads((tmp_path / RESULT_FILE).read_text()) == {"exit_code": 0, "reason": "all 4 ranks finished"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [RESULT_FILE]


def test_a_long_reason_is_cut_to_fit_and_stays_json() -> None:
    data = verdict_file.encode(1, "x" * 100_000)
    assert len(data) < RESERVE_BYTES and json.loads(data)["reason"].endswith("[cut]")


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_on_a_really_full_disk(tmp_path: Path) -> None:
    d = tmp_path / "run"
    d.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], check=True)
    try:
        verdict_file.reserve(d, 0)
        with pytest.raises(OSError), open(d / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        with pytest.raises(OSError):  # nothing new fits
            (d / "probe").write_bytes(b"x" * 8192)
        verdict_file.write(d, 0, 1, "no spare left: node3 failed")
        assert json.loads((d / RESULT_FILE).read_text())["reason"] == "no spare left: node3 failed"
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
