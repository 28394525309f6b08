"""resild probe: InfiniBand port state from sysfs.

Reads /sys/class/infiniband/<device>/ports/<port>/state ("4: ACTIVE"). A port
that is not ACTIVE is DEGRADED while it is coming up (INIT, ARMED) and FAILED
when it is DOWN or its state cannot be read. Config (``[probe_options.infiniband]``):
``root`` (sysfs dir, for tests), ``expected_ports`` (fewer ports found = FAILED:
a vanished HCA leaves no state file to read), ``ignore`` (["mlx5_0/1", ...]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resild.health.model import Verdict, worst
from resild.health.probes import ProbeResult

DEFAULT_ROOT = "/sys/class/infiniband"
_COMING_UP = {"INIT", "ARMED"}


@dataclass(frozen=True)
class PortState:
    port: str  # "mlx5_0/1"
    state: str  # "ACTIVE", "DOWN", ... or "UNREADABLE"


def port_verdict(state: str) -> Verdict:
    if state == "ACTIVE":
        return Verdict.HEALTHY
    return Verdict.DEGRADED if state in _COMING_UP else Verdict.FAILED


def judge(ports: list[PortState], expected_ports: int | None) -> ProbeResult:
    """Pure: verdict and reasons from the port states read."""
    reasons = [f"InfiniBand port {p.port} is {p.state}" for p in ports if port_verdict(p.state) is not Verdict.HEALTHY]
    verdict = worst(*(port_verdict(p.state) for p in ports))
    if expected_ports is not None and len(ports) < expected_ports:
        verdict = Verdict.FAILED
        reasons.insert(0, f"only {len(ports)} of {expected_ports} expected InfiniBand ports found")
    return ProbeResult(verdict, reasons, {"ports": {p.port: p.state for p in ports}})


def read_ports(root: Path) -> list[PortState]:
    ports: list[PortState] = []
    if not root.is_dir():
        return ports
    for state_file in sorted(root.glob("*/ports/*/state")):
        name = f"{state_file.parents[2].name}/{state_file.parent.name}"
        try:
            text = state_file.read_text().strip()
        except OSError:
            ports.append(PortState(name, "UNREADABLE"))
            continue
        # "4: ACTIVE" -> "ACTIVE"; tolerate a bare name.
        ports.append(PortState(name, text.split(":", 1)[-1].strip().upper() or "UNREADABLE"))
    return ports


@dataclass
class InfinibandProbe:
    root: Path = Path(DEFAULT_ROOT)
    expected_ports: int | None = None
    ignore: set[str] = field(default_factory=set)
    name: str = "infiniband"

    def check(self) -> ProbeResult:
        ports = [p for p in read_ports(self.root) if p.port not in self.ignore]
        return judge(ports, self.expected_ports)


def make_probe(options: Mapping[str, Any]) -> InfinibandProbe:
    unknown = set(options) - {"root", "expected_ports", "ignore"}
    if unknown:
        raise ValueError(f"unknown infiniband option(s): {', '.join(sorted(unknown))}")
    expected = options.get("expected_ports")
    if expected is not None and (not isinstance(expected, int) or isinstance(expected, bool) or expected < 0):
        raise ValueError("infiniband option expected_ports must be a non-negative integer")
    return InfinibandProbe(Path(options.get("root", DEFAULT_ROOT)), expected, set(options.get("ignore", [])))
