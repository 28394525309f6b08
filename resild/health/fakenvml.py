"""Build and drive the fake ``libnvidia-ml.so.1`` (``fake_nvml.c``).

The fake stands in for the NVIDIA driver's NVML library so the real
nvidia-ml-py binding, the probe and the daemon run on machines without a GPU
(tests, the ``--local`` demo). The control-file format is documented at the top
of ``fake_nvml.c``; :class:`FakeNvmlControl` writes it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from importlib import resources
from pathlib import Path

LIB_NAME = "libnvidia-ml.so.1"
_OLD_DRIVER_FLAG = "-DFAKE_NVML_OLD_DRIVER"


def build_fake_nvml(out_dir: Path, *, old_driver: bool = False) -> Path:
    """Compile ``fake_nvml.c`` into ``out_dir/libnvidia-ml.so.1``; return ``out_dir``.

    Rebuilds only when the library is missing, older than the C source, or was
    built with other flags. ``old_driver=True`` leaves out the functions a
    pre-R460 driver lacks. Raises RuntimeError when gcc is missing or fails.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIB_NAME
    flags_file = out_dir / (LIB_NAME + ".flags")
    flags = [_OLD_DRIVER_FLAG] if old_driver else []
    with resources.as_file(resources.files(__package__) / "fake_nvml.c") as src:
        if _up_to_date(target, flags_file, src, flags):
            return out_dir
        gcc = shutil.which("gcc") or shutil.which("cc")
        if gcc is None:
            raise RuntimeError("cannot build the fake NVML library: no gcc/cc on PATH")
        # Build to a temporary name and rename, so concurrent builders never
        # leave a half-written library where the loader can find it.
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".fake_nvml.", suffix=".so")
        os.close(fd)
        cmd = [gcc, "-shared", "-fPIC", "-O1", "-Wall", "-fvisibility=hidden", *flags, "-o", tmp, str(src), "-lpthread"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if proc.returncode != 0:
                raise RuntimeError(f"building the fake NVML library failed: {' '.join(cmd)}\n{proc.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        flags_file.write_text(" ".join(flags))
    return out_dir


def _up_to_date(target: Path, flags_file: Path, src: Path, flags: list[str]) -> bool:
    try:
        if target.stat().st_mtime < src.stat().st_mtime:
            return False
        return flags_file.read_text() == " ".join(flags)
    except OSError:
        return False


def fake_nvml_env(lib_dir: Path, control_path: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for a child process that should load the fake library."""
    env = dict(os.environ if base is None else base)
    old = env.get("LD_LIBRARY_PATH")
    env["LD_LIBRARY_PATH"] = str(lib_dir) + (os.pathsep + old if old else "")
    env["FAKE_NVML_CONTROL"] = str(control_path)
    return env


class FakeNvmlControl:
    """Writes the fake library's control file, atomically, after each change.

    >>> ctl = FakeNvmlControl(path, gpus=8)
    >>> ctl.set(3, "nvlink", 5, 0)      # GPU 3, link 5 down
    >>> ctl.event(2, "xid", 79)          # delivered once to registered event sets
    """

    def __init__(self, path: Path, gpus: int = 1) -> None:
        self.path = Path(path)
        self._lines: list[str] = [f"gpus {gpus}"]
        self._write()

    def line(self, text: str) -> FakeNvmlControl:
        """Append one raw directive (see the format in fake_nvml.c)."""
        self._lines.append(text)
        self._write()
        return self

    def set(self, gpu: int | str, key: str, *values: int | str) -> FakeNvmlControl:
        return self.line(" ".join(["set", str(gpu), key, *map(str, values)]))

    def fail(self, gpu: int | str, function: str, code: int) -> FakeNvmlControl:
        return self.line(f"fail {gpu} {function} {code}")

    def event(self, gpu: int, kind: str, *args: int) -> FakeNvmlControl:
        return self.line(" ".join(["event", str(gpu), kind, *map(str, args)]))

    def _write(self) -> None:
        # A new inode per write: the library notices the change even when size
        # and (coarse) mtime stay the same.
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text("\n".join(self._lines) + "\n")
        os.replace(tmp, self.path)
