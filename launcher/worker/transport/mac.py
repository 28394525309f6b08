"""Message authentication for training state on the wire (replay, snapshot copies, the
rollback fetch): a Poly1305 tag under a one-time key derived from the job's data key.

The CRC-32 those transfers carried catches damage, not forgery: anyone who can reach a
gloo group's listening port (any local user, the network) could send state a rank would
load. The data key reaches every worker in WELCOME, over the CURVE channel, from the
controller, which derives it from its own secret key (resild.wire.keys.data_key: every
standby controller holds the same one): a stranger without a node key never learns it.

Poly1305 (OpenSSL, through `cryptography`) runs at ~5 GB/s here against ~10-20 GB/s for
zlib-ng's CRC-32, and needs a key used for one message only: each message's key is
HMAC-SHA-256(data key, what names the message), and what names it is unique: a replay's
epoch and number in it, a snapshot's random nonce its owner draws, a group's pair proof
its epoch, group and direction (a group is formed once an epoch: group_auth), so no two
messages ever share a key. Host memory only: a CUDA replay keeps its device checksum (no
GPU MAC here; said in docs/security.md).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence

import torch
from cryptography.hazmat.primitives.poly1305 import Poly1305

KEY_BYTES = 32
TAG_WORDS = 2  # a 16-byte tag as two int64, where a CRC was one
# The first name of every message: what kind of transfer it belongs to.
REPLAY_META, REPLAY_PART, SNAPSHOT, GROUP_PAIR = 1, 2, 3, 4


def new_nonce() -> int:
    """A sender's nonce for one exchange (positive int63: it travels as an int64)."""
    return int.from_bytes(os.urandom(8), "big") >> 1


class Mac:
    def __init__(self, key: bytes) -> None:
        if len(key) != KEY_BYTES:
            raise ValueError(f"a data key is {KEY_BYTES} bytes, not {len(key)}")
        self._key = key

    @staticmethod
    def from_hex(text: object) -> Mac | None:
        """The key WELCOME carries (hex), or None where there is none (a rank run alone)."""
        if not isinstance(text, str) or len(text) != 2 * KEY_BYTES:
            return None
        try:
            return Mac(bytes.fromhex(text))
        except ValueError:
            return None

    def tag(self, parts: Sequence[torch.Tensor | bytes], *names: int) -> tuple[int, ...]:
        """The tag of `parts` (host uint8 tensors or bytes, in order) under the one-time key
        `names` derive, as TAG_WORDS int64 values."""
        one_time = hmac.new(self._key, struct.pack(f"<{len(names)}q", *names), hashlib.sha256).digest()
        p = Poly1305(one_time)
        for x in parts:
            if isinstance(x, torch.Tensor):
                if x.numel():
                    p.update(x.numpy().data)
            else:
                p.update(x)
        return tuple(struct.unpack("<2q", p.finalize()))
