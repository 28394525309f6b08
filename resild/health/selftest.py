"""The GPU self-test of qualification: a matmul checked against a float64 reference on
the host, and a host -> device -> host copy checked bit for bit, on every GPU (the CPU
where there is none: the CPU lab). torch is imported here only: the node daemon's install
has none, and a self-test that cannot run fails (a health check never fails open).

    python -m resild.health.selftest [--json]
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

MATMUL_N = 512
COPY_BYTES = 16 << 20
# Relative error of the matmul against float64: TF32 on a GPU is ~1e-3; a flipped high bit
# or a dead SM is orders beyond. On the CPU float32 is ~1e-6.
TOLERANCE = {"cuda": 1e-2, "cpu": 1e-4}


@dataclass
class DeviceResult:
    device: str
    ok: bool
    matmul_rel_err: float | None = None
    copy_ok: bool | None = None
    copy_gb_s: float | None = None
    error: str = ""


@dataclass
class SelfTest:
    ok: bool
    devices: list[DeviceResult] = field(default_factory=list)
    error: str = ""  # the test could not run at all
    seconds: float = 0.0

    def reasons(self) -> list[str]:
        if self.error:
            return [f"self-test: {self.error}"]
        return [f"self-test on {d.device}: {d.error}" for d in self.devices if not d.ok]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(corrupt: Callable[[Any], Any] | None = None) -> SelfTest:
    """`corrupt`: applied to each device's matmul result (the tests' stand-in for a bad GPU)."""
    t0 = time.monotonic()
    try:
        import torch
    except ImportError:
        return SelfTest(False, error="torch is not installed here (pip install 'resild[launcher]'): cannot run")
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else ["cpu"]
    results = [_one(torch, d, corrupt) for d in devices]
    return SelfTest(all(r.ok for r in results), results, seconds=round(time.monotonic() - t0, 3))


def _one(torch: Any, device: str, corrupt: Callable[[Any], Any] | None) -> DeviceResult:
    try:
        g = torch.Generator().manual_seed(0)
        a = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        b = torch.randn(MATMUL_N, MATMUL_N, generator=g)
        ref = a.double() @ b.double()
        got = a.to(device) @ b.to(device)
        if corrupt is not None:
            got = corrupt(got)
        err = float(((got.double().cpu() - ref).abs().max() / ref.abs().max()).item())
        x = torch.randint(-(1 << 31), (1 << 31) - 1, (COPY_BYTES // 4,), generator=g, dtype=torch.int32)
        t = time.perf_counter()
        back = x.to(device).cpu()
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        dt = time.perf_counter() - t
        copy_ok = bool(torch.equal(x, back))
    except Exception as e:  # a GPU that errors is a GPU that fails its test
        return DeviceResult(device, False, error=f"{type(e).__name__}: {e}"[:300])
    tol = TOLERANCE["cuda" if device.startswith("cuda") else "cpu"]
    errors = []
    if not err <= tol:  # NaN fails too
        errors.append(f"matmul off by {err:.3g} (relative; at most {tol:g})")
    if not copy_ok:
        errors.append("host-device copy came back different")
    return DeviceResult(
        device,
        not errors,
        round(err, 9),
        copy_ok,
        round(2 * COPY_BYTES / dt / 1e9, 3) if dt > 0 else None,
        "; ".join(errors),
    )


def main() -> int:
    r = run()
    if "--json" in sys.argv[1:]:
        print(json.dumps(r.to_dict()))
    else:
        print("self-test: " + ("passed" if r.ok else "FAILED: " + "; ".join(r.reasons())))
    return 0 if r.ok else 1


if __name__ == "__main__":
    sys.exit(main())
