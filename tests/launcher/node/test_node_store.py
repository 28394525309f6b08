"""The node process's store: node-local keys served on the node, the job's forwarded to the
controller once per key in flight, every asker answered under its own id."""

from __future__ import annotations

import pytest

from launcher.node.node_store import FORWARD_GRACE_S, NodeStore
from resild.rendezvous import Rendezvous, b64

pytestmark = pytest.mark.timeout(30)

W0, W1, W2 = b"w0", b"w1", b"w2"


def req(rid: int, op: str, key: str, scope: str = "job", **kw: object) -> dict[str, object]:
    return {"node": "n0", "id": rid, "op": op, "keys": [key], "scope": scope, "timeout_s": 5.0, **kw}


def test_a_node_scope_request_is_served_on_the_node_and_never_forwarded() -> None:
    st = NodeStore()
    replies, fwd = st.request(W0, req(1, "get", "resild/e1/shard0/0", "node"), now=0.0)
    assert replies == [] and fwd is None  # parked on the node until set
    replies, fwd = st.request(W1, req(7, "set", "resild/e1/shard0/0", "node", value=b64(b"addr")), now=0.1)
    assert fwd is None
    assert sorted(replies, key=lambda r: r[0]) == [
        (W0, {"id": 1, "ok": True, "value": b64(b"addr")}),
        (W1, {"id": 7, "ok": True}),
    ]
    assert st.forwarded == {}


def test_gets_of_one_key_in_flight_go_to_the_controller_once_and_answer_every_asker() -> None:
    st = NodeStore()
    _, fwd = st.request(W0, req(3, "get", "resild/e2/world/uid"), now=0.0)
    assert fwd is not None and fwd["op"] == "get" and "scope" not in fwd and "node" not in fwd
    for ident, rid in ((W1, 3), (W2, 9)):  # ids are per worker: the same id from two workers
        assert st.request(ident, req(rid, "get", "resild/e2/world/uid"), now=0.01) == ([], None)
    assert st.coalesced == 2
    out = st.reply({"id": fwd["id"], "ok": True, "value": b64(b"u")})
    assert out == [(W0, {"id": 3, "ok": True, "value": b64(b"u")}), (W1, {"id": 3, "ok": True, "value": b64(b"u")}),
                   (W2, {"id": 9, "ok": True, "value": b64(b"u")})]  # fmt: skip
    # answered: the next get of that key is a new request (it may have been rewritten)
    _, again = st.request(W0, req(4, "get", "resild/e2/world/uid"), now=0.02)
    assert again is not None and again["id"] != fwd["id"]


def test_multi_gets_of_the_same_keys_in_flight_go_to_the_controller_once() -> None:
    # every member of a gloo group asks for all its members' addresses: one per node
    st = NodeStore()
    keys = ["resild/e3/snap/0", "resild/e3/snap/1"]
    _, fwd = st.request(W0, {**req(1, "multi_get", ""), "keys": keys}, now=0.0)
    assert fwd is not None and fwd["op"] == "multi_get" and fwd["keys"] == keys
    assert st.request(W1, {**req(4, "multi_get", ""), "keys": keys}, now=0.0) == ([], None)
    _, other = st.request(W2, {**req(2, "multi_get", ""), "keys": keys[:1]}, now=0.0)  # other keys: its own
    assert other is not None and st.coalesced == 1
    _, single = st.request(W2, req(3, "get", keys[0]), now=0.0)  # a get is not answered by a multi_get
    assert single is not None
    values = [b64(b"a0"), b64(b"a1")]
    assert st.reply({"id": fwd["id"], "ok": True, "values": values}) == [
        (W0, {"id": 1, "ok": True, "values": values}),
        (W1, {"id": 4, "ok": True, "values": values}),
    ]


def test_other_operations_are_forwarded_one_for_one() -> None:
    st = NodeStore()
    f1 = st.request(W0, req(1, "add", "resild/e1/world/n", n=1), now=0.0)[1]
    f2 = st.request(W1, req(1, "add", "resild/e1/world/n", n=1), now=0.0)[1]
    assert f1 is not None and f2 is not None and f1["id"] != f2["id"]
    assert st.reply({"id": f2["id"], "ok": True, "n": 2}) == [(W1, {"id": 1, "ok": True, "n": 2})]
    assert st.reply({"id": f2["id"], "ok": True, "n": 2}) == []  # a duplicate answers nobody


def test_a_leader_change_fails_every_forward_in_flight_but_keeps_node_keys() -> None:
    st = NodeStore()
    st.request(W0, req(1, "set", "resild/e1/tp/0", "node", value=b64(b"a")), now=0.0)
    _, fwd = st.request(W0, req(2, "get", "resild/e1/world/uid"), now=0.0)
    st.request(W1, req(5, "get", "resild/e1/world/uid"), now=0.0)
    out = st.leader_changed()
    assert {(i, b["id"], b["ok"]) for i, b in out} == {(W0, 2, False), (W1, 5, False)}
    assert st.forwarded == {} and st.gets == {}
    assert fwd is not None and st.reply({"id": fwd["id"], "ok": True, "value": ""}) == []
    assert st.local.kv == {"resild/e1/tp/0": b"a"}


def test_a_forward_the_controller_never_answers_is_given_up_after_its_timeout() -> None:
    st = NodeStore()
    st.request(W0, req(1, "get", "resild/e1/world/uid"), now=0.0)
    assert st.next_deadline() == pytest.approx(5.0 + FORWARD_GRACE_S)
    assert st.expire(5.0) == []
    out = st.expire(5.0 + FORWARD_GRACE_S)
    assert out == [(W0, {"id": 1, "ok": False, "error": "no answer from the controller"})]
    assert st.next_deadline() == float("inf")


def test_node_keys_of_old_epochs_are_forgotten_as_at_the_controller() -> None:
    st = NodeStore(local=Rendezvous())
    st.request(W0, req(1, "set", "resild/e1/shard/0", "node", value=b64(b"a")), now=0.0)
    st.request(W0, req(2, "set", "resild/e5/shard/0", "node", value=b64(b"b")), now=0.0)
    assert list(st.local.kv) == ["resild/e5/shard/0"]
