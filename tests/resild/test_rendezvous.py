"""The controller's rendezvous keys: c10d store semantics, parked waits released by a
set or by their deadline, limits, and old epochs forgotten."""

from __future__ import annotations

from typing import Any

from resild.rendezvous import KEEP_EPOCHS, MAX_REPLY_VALUES_CHARS, MAX_VALUE_BYTES, Rendezvous, b64, unb64

A, B = b"worker-a", b"worker-b"


def req(rid: int, op: str, *keys: str, **kw: Any) -> dict[str, Any]:
    return {"id": rid, "op": op, "keys": list(keys), **kw}


def test_a_get_of_a_key_not_yet_set_waits_until_it_is_set() -> None:
    r = Rendezvous()
    assert r.handle(A, req(1, "get", "resild/e1/world/0"), now=0.0) == []
    out = r.handle(B, req(7, "set", "resild/e1/world/0", value=b64(b"addr")), now=0.1)
    assert (B, {"id": 7, "ok": True}) in out
    assert (A, {"id": 1, "ok": True, "value": b64(b"addr")}) in out
    assert r.n_parked == 0


def test_a_wait_for_several_keys_is_answered_only_when_all_are_set() -> None:
    r = Rendezvous()
    assert r.handle(A, req(1, "wait", "k1", "k2"), now=0.0) == []
    assert r.handle(B, req(2, "set", "k1", value=b64(b"x")), now=0.0) == [(B, {"id": 2, "ok": True})]
    out = r.handle(B, req(3, "set", "k2", value=b64(b"y")), now=0.0)
    assert (A, {"id": 1, "ok": True}) in out


def test_a_multi_get_is_answered_once_every_key_is_set_with_the_values_that_fit_one_frame() -> None:
    r = Rendezvous()
    assert r.handle(A, req(1, "multi_get", "k0", "k1"), now=0.0) == []
    r.handle(B, req(2, "set", "k0", value=b64(b"a")), now=0.0)
    out = r.handle(B, req(3, "set", "k1", value=b64(b"bc")), now=0.0)
    assert (A, {"id": 1, "ok": True, "values": [b64(b"a"), b64(b"bc")]}) in out
    big = b"x" * (MAX_REPLY_VALUES_CHARS // 2)  # two of them are over the reply's budget in base64
    for i, k in enumerate(("b0", "b1", "b2")):
        r.handle(B, req(10 + i, "set", k, value=b64(big)), now=0.0)
    (_, reply), *_ = r.handle(A, req(20, "multi_get", "b0", "b1", "b2"), now=0.0)
    assert reply["ok"] is True and [unb64(v) for v in reply["values"]] == [big]  # the caller asks for b1, b2 again
    huge = b"y" * (MAX_VALUE_BYTES)  # one value alone over the budget: still answered
    r.handle(B, req(30, "set", "h", value=b64(huge)), now=0.0)
    (_, reply), *_ = r.handle(A, req(31, "multi_get", "h", "b0"), now=0.0)
    assert [unb64(v) for v in reply["values"]] == [huge]


def test_a_parked_request_past_its_deadline_gets_an_error() -> None:
    r = Rendezvous()
    r.handle(A, req(1, "get", "never", timeout_s=5.0), now=10.0)
    assert r.expire(14.9) == []
    (to, reply), *rest = r.expire(15.0)
    assert not rest and to == A and reply["id"] == 1 and not reply["ok"] and "never" in reply["error"]
    assert r.n_parked == 0 and not r.parked


def test_add_check_compare_set_delete_and_num_keys_follow_c10d() -> None:
    r = Rendezvous()
    assert r.handle(A, req(1, "add", "n", n=2), 0.0)[0][1]["n"] == 2
    assert r.handle(A, req(2, "add", "n", n=3), 0.0)[0][1]["n"] == 5
    assert r.handle(A, req(3, "check", "n", "m"), 0.0)[0][1]["n"] == 0
    got = r.handle(A, req(4, "compare_set", "m", expected=b64(b""), value=b64(b"v1")), 0.0)[0][1]
    assert unb64(got["value"]) == b"v1"
    got = r.handle(A, req(5, "compare_set", "m", expected=b64(b"other"), value=b64(b"v2")), 0.0)[0][1]
    assert unb64(got["value"]) == b"v1"  # unchanged: the current value comes back
    assert r.handle(A, req(6, "num_keys"), 0.0)[0][1]["n"] == 2
    assert r.handle(A, req(7, "delete", "m"), 0.0)[0][1]["n"] == 1
    assert r.handle(A, req(8, "check", "m"), 0.0)[0][1]["n"] == 0


def test_an_oversized_value_or_a_bad_request_is_refused_with_an_error_not_stored() -> None:
    r = Rendezvous()
    out = r.handle(A, req(1, "set", "big", value=b64(b"x" * (MAX_VALUE_BYTES + 1))), 0.0)
    assert out[0][1]["ok"] is False and "limit" in out[0][1]["error"]
    assert r.handle(A, req(2, "set", "k", value="not base64!"), 0.0)[0][1]["ok"] is False
    assert r.handle(A, req(3, "get", "a", "b"), 0.0)[0][1]["ok"] is False
    assert r.handle(A, req(4, "get", "x" * 600), 0.0)[0][1]["ok"] is False
    assert not r.kv and r.nbytes == 0


def test_keys_of_old_epochs_are_forgotten() -> None:
    r = Rendezvous()
    for e in range(1, 6):
        r.handle(A, req(e, "set", f"resild/e{e}/world/0", value=b64(b"addr")), 0.0)
    kept = sorted(r.kv)
    assert kept == [f"resild/e{e}/world/0" for e in range(6 - KEEP_EPOCHS, 6)]
    assert r.nbytes == 4 * KEEP_EPOCHS
