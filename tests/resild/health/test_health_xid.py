from __future__ import annotations

import pytest

from resild.health.model import Verdict
from resild.health.xid import (
    XID_TABLE,
    HealthClass,
    classify_recovery_action,
    classify_xid,
    validate_overrides,
)

pytestmark = pytest.mark.timeout(30)

A, D, F = HealthClass.APP_ERROR, HealthClass.DEGRADED, HealthClass.FAILED

# Every row of shared/reference/gpu-health.md: (code, class, action fragment, description fragment)
REFERENCE_ROWS = [
    (13, A, "restart app", "graphics engine"),
    (31, A, "restart app", "page fault"),
    (43, A, "ignore", "stopped processing"),
    (45, A, "follow the other Xid", "preemptive cleanup"),
    (46, F, "reset GPU", "GPU timeout"),
    (48, F, "drain", "double-bit ECC"),
    (62, F, "reset GPU", "micro-controller halt"),
    (63, D, "ignore", "row-remap event"),
    (64, F, "reset GPU", "row-remap failure"),
    (74, F, "workflow", "NVLink error"),
    (79, F, "reboot node", "fallen off the bus"),
    (92, D, "ignore", "single-bit ECC"),
    (94, A, "restart app", "contained ECC"),
    (95, F, "reset GPU", "uncontained ECC"),
    (109, F, "reset GPU", "context-switch timeout"),
    (119, F, "reset GPU", "GSP RPC timeout"),
    (120, F, "reset GPU", "GSP error"),
    (136, F, "reset GPU", "NVLink training"),
    (140, F, "reset GPU", "ECC"),
    (143, F, "reset GPU", "initialization error"),
    (144, D, "decode", "NVLink5"),
    (145, D, "decode", "NVLink5"),
    (146, D, "decode", "NVLink5"),
    (147, D, "decode", "NVLink5"),
    (148, D, "decode", "NVLink5"),
    (149, F, "reset GPU", "NVLink5 fatal"),
    (150, F, "reset GPU", "NVLink5 fatal"),
    (154, D, "field 230", "recovery action"),
    (155, F, "reset GPU", "NVLink"),
    (156, F, "reset GPU", "retirement"),
    (158, F, "reset GPU", "fatal timeout"),
]


@pytest.mark.parametrize(("code", "cls", "action", "desc"), REFERENCE_ROWS)
def test_reference_table_row(code: int, cls: HealthClass, action: str, desc: str) -> None:
    xc = classify_xid(code)
    assert xc.health_class is cls
    assert xc.known and not xc.overridden
    assert action in xc.action
    assert desc.lower() in xc.description.lower()
    assert f"Xid {code}" in xc.reason and xc.description in xc.reason


def test_table_has_exactly_the_reference_rows() -> None:
    assert set(XID_TABLE) == {row[0] for row in REFERENCE_ROWS}


def test_verdicts() -> None:
    assert classify_xid(13).verdict is Verdict.HEALTHY  # app error: the GPU itself is fine
    assert classify_xid(63).verdict is Verdict.DEGRADED
    assert classify_xid(79).verdict is Verdict.FAILED


@pytest.mark.parametrize("code", [0, 1, 68, 999, 12345])
def test_unknown_code_is_degraded(code: int) -> None:
    xc = classify_xid(code)
    assert xc.health_class is D and not xc.known
    assert "unknown" in xc.reason and "not in the Xid table" in xc.reason


def test_overrides() -> None:
    overrides = {79: "failed", 43: "degraded", "13": "FAILED", 999: HealthClass.APP_ERROR}
    assert classify_xid(43, overrides).health_class is D
    assert classify_xid(43, overrides).overridden
    assert "overridden" in classify_xid(43, overrides).reason
    assert classify_xid(13, overrides).health_class is F  # string key, any case
    assert classify_xid(999, overrides).health_class is A  # unknown code, overridden
    assert classify_xid(31, overrides).health_class is A  # untouched row
    assert classify_xid(79, {79: "app_error"}).verdict is Verdict.HEALTHY


@pytest.mark.parametrize("bad", [{79: "fatal"}, {79: 3}, {79: None}, {"x79": "failed"}, {-1: "failed"}])
def test_invalid_override_raises_clear_error(bad: dict) -> None:
    with pytest.raises(ValueError, match="invalid Xid override"):
        classify_xid(79, bad)
    with pytest.raises(ValueError, match="invalid Xid override"):
        validate_overrides(bad)


def test_invalid_override_names_the_choices() -> None:
    with pytest.raises(ValueError, match="'app_error', 'degraded', 'failed'"):
        validate_overrides({79: "fatal"})


@pytest.mark.parametrize(
    ("action", "verdict"),
    [
        (0, Verdict.HEALTHY),
        (1, Verdict.FAILED),
        (2, Verdict.FAILED),
        (3, Verdict.FAILED),
        (4, Verdict.DEGRADED),
        (5, Verdict.FAILED),
        (6, Verdict.FAILED),
        (7, Verdict.FAILED),
        (42, Verdict.DEGRADED),
    ],
)
def test_recovery_actions(action: int, verdict: Verdict) -> None:
    v, reason = classify_recovery_action(action)
    assert v is verdict
    assert f"recovery action {action}" in reason
