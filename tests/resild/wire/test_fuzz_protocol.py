"""Fuzzing the wire: no frame makes decode raise anything but ProtocolError, and
what it accepts is finite, bounded and re-encodes to itself."""

from __future__ import annotations

import json
import math
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resild.wire.protocol import (
    BODY_TYPES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Event,
    Message,
    MsgType,
    ProtocolError,
    decode,
    encode,
)

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELD_NAMES = sorted(
    {f.name for cls in BODY_TYPES.values() for f in fields(cls)} | {"bytes", "seconds", "t_mono", "epoch", "extra"}
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 70), max_value=1 << 70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=40)
    | st.sampled_from(["healthy", "failed", "resumed", "state_replayed", "failure_detected", "n1", "commit"])
)
json_values = st.recursive(
    scalars,
    lambda c: (
        st.lists(c, max_size=4) | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), c, max_size=4)
    ),
    max_leaves=25,
)
bodies = st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=10), json_values, max_size=8)


def _all_finite(v: Any) -> bool:
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, dict):
        return all(_all_finite(x) for x in v.values())
    if isinstance(v, list):
        return all(_all_finite(x) for x in v)
    return True


def _check_accepted(m: Message) -> None:
    assert _all_finite(m.body) and math.isfinite(m.deadline) and 0 <= m.seq < (1 << 53)
    assert 0 < len(m.sender) <= 256
    cls = BODY_TYPES.get(m.type)
    if cls is not None:
        assert isinstance(m.typed, cls)
    if isinstance(m.typed, Event):  # a peer can never name a controller event
        assert m.body["name"] in {
            "group_reformed",
            "state_replayed",
            "resumed",
            "process_running",
            "process_exited",
            "process_zombie",
            "process_hung",
        } or m.body["name"].startswith("worker.")
    again = decode(encode(m))  # what decode accepts, encode can send, and it is stable
    assert again == m and again.typed == m.typed


@SETTINGS
@given(st.binary(max_size=4096))
def test_decode_never_raises_on_bytes(frame: bytes) -> None:
    try:
        m = decode(frame)
    except ProtocolError:
        return
    _check_accepted(m)


@SETTINGS
@given(
    mtype=st.sampled_from([t.value for t in MsgType]) | st.text(max_size=12),
    body=bodies,
    seq=st.integers(min_value=-5, max_value=1 << 60) | st.floats(allow_nan=True),
    deadline=st.floats(allow_nan=True, allow_infinity=True) | st.integers() | st.text(max_size=3),
    sender=st.text(max_size=300),
    v=st.sampled_from([PROTOCOL_VERSION, 0, 2, True, "1"]),
)
def test_decode_envelopes_and_bodies(mtype: str, body: dict, seq: Any, deadline: Any, sender: str, v: Any) -> None:
    frame = json.dumps(
        {"v": v, "type": mtype, "sender": sender, "seq": seq, "deadline": deadline, "body": body}, allow_nan=True
    ).encode()
    try:
        m = decode(frame)
    except ProtocolError as e:
        assert e.code in {"malformed", "bad_version", "bad_type", "bad_body", "too_large"}
        return
    _check_accepted(m)


@SETTINGS
@given(mtype=st.sampled_from(list(BODY_TYPES)), body=bodies)
def test_every_typed_body(mtype: MsgType, body: dict) -> None:
    """Well-framed messages of every typed kind with arbitrary bodies."""
    frame = json.dumps(
        {"v": PROTOCOL_VERSION, "type": mtype.value, "sender": "n1/node", "seq": 1, "deadline": 1e10, "body": body},
        allow_nan=True,
    ).encode()
    try:
        m = decode(frame)
    except ProtocolError as e:
        assert e.code in {"malformed", "bad_body"}
        return
    _check_accepted(m)


def test_frame_limit_is_checked_before_parsing() -> None:
    with pytest.raises(ProtocolError, match="too_large"):
        decode(b"[" * (MAX_FRAME_BYTES + 1))
