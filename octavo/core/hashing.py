"""Chained block hashes: a full block's identity is its parent's hash, its tokens and whatever
else changes its KV (LoRA adapter, cache salt). sha256, so every process agrees."""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

_ROOT = b"octavo-kv-v1"


def hash_block(parent: BlockHash | None, tokens: Sequence[int],
               extra: tuple[object, ...] = ()) -> BlockHash:
    h = hashlib.sha256(parent if parent is not None else _ROOT)
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    if extra:
        h.update(repr(extra).encode())
    return h.digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        first_block_extra: tuple[object, ...] = ()) -> None:
    """Append the hashes of every full block of `token_ids` not hashed yet. The extra keys go
    into the first block only; the chain carries them to every later block."""
    for i in range(len(hashes), len(token_ids) // block_size):
        parent = hashes[-1] if hashes else None
        extra = first_block_extra if i == 0 else ()
        hashes.append(hash_block(parent, token_ids[i * block_size:(i + 1) * block_size], extra))
