"""Directories resild keeps its state in are the job user's own.

A directory under a shared place (/tmp, a shared file system) may already exist, made by
someone else: used as found, its owner could read, move or replace what resild keeps
there (etcd's data, checkpoints whose metadata torch unpickles). `private_dir` makes the
directory atomically with mode 0700, or accepts an existing one only if it is a real
directory (not a link) owned by this user and neither group- nor world-writable
(`writable_ok=False`, the default, also refuses group/world read: 0700 exactly is not
required, access by others is). `check_own_file` is the same rule for one file.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotOwnError(OSError):
    """A path resild would trust is not the job user's own; str() is one line."""


def _check(path: Path, st: os.stat_result, what: str, others_may_read: bool) -> None:
    if st.st_uid != os.getuid():
        raise NotOwnError(f"{path}: the {what} exists and belongs to uid {st.st_uid}, not this user ({os.getuid()})")
    mode = stat.S_IMODE(st.st_mode)
    bad = 0o022 if others_may_read else 0o077
    if mode & bad:
        who = "writable" if mode & 0o022 else "readable"
        raise NotOwnError(f"{path}: the {what} is {who} by other users (mode {mode:04o}): chmod go-rwx it")


def private_dir(path: Path, what: str = "directory", others_may_read: bool = False) -> Path:
    """`path` made (0700, its missing parents too) or checked as this user's own."""
    path = Path(path)
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        os.mkdir(path, 0o700)  # atomic: no window in which another user's directory is taken for ours
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotOwnError(f"{path}: the {what} exists and is not a directory (a link or a file)")
    _check(path, st, what, others_may_read)
    return path


def check_own_dir(path: Path, what: str = "directory") -> None:
    """`path` (it exists) is a real directory of this user's that no other user may write."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotOwnError(f"{path}: the {what} is not a directory (a link or a file)")
    _check(Path(path), st, what, others_may_read=True)


def check_own_file(path: Path, what: str = "file") -> None:
    """`path` (it exists) is a regular file of this user's that no other user may write."""
    st = os.lstat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotOwnError(f"{path}: the {what} is not a regular file (a link or a device)")
    _check(Path(path), st, what, others_may_read=True)
