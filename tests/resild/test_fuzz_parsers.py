"""Fuzzing the kernel-log Xid parser and the fault-spec parser: no input raises an
unexpected exception, takes long, or is accepted when it should not be."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resild.controller.faults import KINDS, Fault, FaultSpecError, parse_fault
from resild.health.kmsg import KmsgXid, parse_xid_line, pci_bus_key

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
XID = "NVRM: Xid (PCI:0000:05:00): 79, pid=1234, name=python, GPU has fallen off the bus."
pieces = st.sampled_from(
    [
        "NVRM: Xid (",
        "PCI:",
        "0000:05:00",
        "0000:b7:00.0",
        "): ",
        "79",
        "9" * 30,
        ", ",
        "\x00",
        "é",
        "٧٩",
        " ",
        "\t",
        ")",
        ":",
        "NVRM: Xid (PCI:0000:05:00): ",
    ]
) | st.text(max_size=8)


@SETTINGS
@given(st.lists(pieces, max_size=30).map("".join))
def test_kmsg_parser_never_raises(line: str) -> None:
    x = parse_xid_line(line)
    if x is not None:
        assert isinstance(x, KmsgXid) and 0 <= x.xid < 10**6
        assert "NVRM: Xid (" in line
        pci_bus_key(x.pci_bus_id)  # what the parser accepts is a bus id the probe can match


@SETTINGS
@given(prefix=st.text(max_size=60).filter(lambda s: "NVRM" not in s))
def test_kmsg_finds_xid_after_any_prefix(prefix: str) -> None:
    x = parse_xid_line(prefix + XID)
    assert x is not None and x.xid == 79 and x.pci_bus_id == "0000:05:00"


def test_kmsg_long_hostile_lines_are_fast() -> None:
    for line in [
        "NVRM: Xid (" * 20000,
        "NVRM: Xid (PCI:0000:05:00): 79, " + " " * 200_000 + "x",
        "NVRM: Xid (PCI:0000:05:00): " + "9" * 100_000,
        "\u0660" * 100_000,
    ]:
        t0 = time.monotonic()
        parse_xid_line(line)
        assert time.monotonic() - t0 < 0.5


specs = st.lists(
    st.sampled_from(
        [
            "kill",
            "xid79",
            "xid",
            "hang",
            ":",
            "@",
            "e",
            "+",
            "node1",
            "local-node0",
            "0.5",
            "40",
            "9" * 40,
            "٤",
            "-",
            ".",
            " ",
            "\n",
            "exception",
            "nodeloss",
            "boom",
        ]
    )
    | st.text(max_size=4),
    max_size=12,
).map("".join)


@SETTINGS
@given(specs)
def test_fault_parser_never_raises_otherwise(spec: str) -> None:
    try:
        f = parse_fault(spec)
    except FaultSpecError as e:
        assert "\n" not in str(e) and len(str(e)) < 400
        return
    assert f.kind in KINDS or (f.kind.startswith("xid") and f.xid is not None)
    assert parse_fault(str(f)) == f and f.step < 10**15 and f.delay_s < 10**7


@SETTINGS
@given(
    kind=st.sampled_from([*KINDS, "xid79", "xid48"]),
    node=st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True),
    step=st.integers(0, 10**9),
    epoch=st.none() | st.integers(0, 1000),
    delay=st.sampled_from([0.0, 0.5, 2.0, 1234567.123456]),
)
def test_valid_specs_round_trip(kind: str, node: str, step: int, epoch: int | None, delay: float) -> None:
    f = Fault(kind, node, 0 if epoch is not None else step, delay, epoch=epoch)
    assert parse_fault(str(f)) == f
