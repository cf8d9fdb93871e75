"""The prefix cache's block keys: a hash chain over full blocks of token ids.

Block i's key is SHA-256 of (block i-1's key, the namespace, block i's tokens as
little-endian int64s), with 32 zero bytes before the first block. The KV service keys its
prefix cache with it (kvcache_svc/core/prefix_cache.py) and publishes those keys in its
events; a router computes the same keys from a prompt's token ids to ask which replica
holds how much of it (gateway/routing.py). Torch-free and model-free.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

TOKEN_BYTES = 8  # token ids are keyed as little-endian int64
ROOT_KEY = bytes(32)  # the parent key of a sequence's first block


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64s. Raises TypeError / OverflowError on non-int64s."""
    packed = array("q", token_ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(token_bytes: bytes) -> tuple[int, ...]:
    return struct.unpack(f"<{len(token_bytes) // TOKEN_BYTES}q", token_bytes)


def _namespace_bytes(namespace: str | None) -> bytes:
    # length-prefixed, and None distinct from "", so no two (namespace, tokens) pairs alias
    if namespace is None:
        return b"\x00"
    encoded = namespace.encode()
    return b"\x01" + struct.pack("<I", len(encoded)) + encoded


def hash_block(parent_key: bytes, namespace: str | None, token_bytes: bytes) -> bytes:
    """The key of a full block: SHA-256 of (parent key, namespace, the block's tokens)."""
    digest = hashlib.sha256(parent_key)
    digest.update(_namespace_bytes(namespace))
    digest.update(token_bytes)
    return digest.digest()


def block_keys(
    token_ids: Sequence[int], block_size: int, namespace: str | None = None, max_blocks: int | None = None
) -> list[bytes]:
    """The keys of the full blocks of `token_ids`, in chain order (at most `max_blocks`)."""
    packed = pack_token_ids(token_ids)
    stride = block_size * TOKEN_BYTES
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    keys, parent = [], ROOT_KEY
    for i in range(count):
        parent = hash_block(parent, namespace, packed[i * stride : (i + 1) * stride])
        keys.append(parent)
    return keys
