"""The job's verdict for resil-run (`result.json` in the run directory), written so that a
full disk cannot lose it.

A replica reserves its verdict's blocks when it starts (`reserve`): a file of fixed
size, written and fsynced while there is room. At the end (`write`) the verdict goes to
a fresh file when it can; on a full disk it is written over the reserved blocks (no new
block needed) and renamed into place. Found by the system soak: a job that finished on a
full run directory was reported "every controller replica was lost", because the
leader could not create the verdict file and died.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

RESULT_FILE = "result.json"  # the leader's verdict on the job, for resil-run
RESERVE_BYTES = 4096  # a verdict is one short JSON object; its reason is cut to fit


def _reserved(run_dir: Path, index: int) -> Path:
    return run_dir / f".{RESULT_FILE}.{index}.reserved"


def reserve(run_dir: Path, index: int) -> None:
    """Room for this replica's verdict, taken now (best effort: a disk already full
    at the start leaves the plain write, which may still find room)."""
    try:
        with open(_reserved(run_dir, index), "wb") as f:
            f.write(b" " * RESERVE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError:
        pass


def encode(exit_code: int, reason: str) -> bytes:
    data = json.dumps({"exit_code": exit_code, "reason": reason}).encode()
    if len(data) > RESERVE_BYTES - 1:
        cut = reason.encode()[: RESERVE_BYTES // 2].decode(errors="ignore") + " [cut]"
        data = json.dumps({"exit_code": exit_code, "reason": cut}).encode()
    return data


def write(run_dir: Path, index: int, exit_code: int, reason: str) -> None:
    """Atomically publish the verdict; on a full disk, through the reserved blocks.
    Raises OSError only when neither way works."""
    data = encode(exit_code, reason)
    tmp = run_dir / f".{RESULT_FILE}.{index}"
    try:
        tmp.write_bytes(data)
        os.replace(tmp, run_dir / RESULT_FILE)
        _reserved(run_dir, index).unlink(missing_ok=True)
        return
    except OSError:
        tmp.unlink(missing_ok=True)
    reserved = _reserved(run_dir, index)
    with open(reserved, "r+b") as f:  # in place: the blocks are ours already
        f.write(data.ljust(RESERVE_BYTES))  # trailing spaces are JSON whitespace
        f.flush()
        os.fsync(f.fileno())
    os.replace(reserved, run_dir / RESULT_FILE)
