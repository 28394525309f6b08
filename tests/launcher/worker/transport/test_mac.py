"""The Poly1305 tags that authenticate training state on the wire (pure: no processes;
the transports' own tests send tagged state between real ranks)."""

from __future__ import annotations

import pytest
import torch

from launcher.worker.transport.mac import Mac, new_nonce

KEY, OTHER = bytes(range(32)), bytes(range(1, 33))


def test_a_tag_names_its_message_and_key() -> None:
    data = torch.arange(100, dtype=torch.uint8)
    mac = Mac(KEY)
    t = mac.tag([data], 2, 5, 1, 0, 0, 3)
    assert len(t) == 2 and t == mac.tag([data[:40], data[40:]], 2, 5, 1, 0, 0, 3)  # pieces in order: the same
    assert t != mac.tag([data], 2, 5, 1, 0, 0, 4) and t != Mac(OTHER).tag([data], 2, 5, 1, 0, 0, 3)
    flipped = data.clone()
    flipped[7] ^= 1
    assert t != mac.tag([flipped], 2, 5, 1, 0, 0, 3)
    assert Mac.from_hex(KEY.hex()) is not None and Mac.from_hex("zz" * 32) is None and Mac.from_hex(None) is None
    with pytest.raises(ValueError, match="32 bytes"):
        Mac(b"short")


def test_nonces_are_positive_int63_and_do_not_repeat() -> None:
    got = {new_nonce() for _ in range(1000)}
    assert len(got) == 1000 and all(0 <= n < 2**63 for n in got)
