"""Bidirectional attention of an encoder (BERT and its kin): every token of a sequence attends to
every other, none to another sequence's. An encoder's requests come whole into one step and
keep no KV cache, so a step's sequences are padded into one batch once (`EncoderBatch`), and
each layer runs one fused attention over it with the padding masked out."""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


class EncoderBatch:
    """A step's sequences (starts[r], ends[r]: rows of the flat step), padded to the longest:
    the flat rows' places in the [sequences, longest] grid and which places hold a token."""

    def __init__(self, starts: np.ndarray, ends: np.ndarray, device: torch.device) -> None:
        lengths = ends - starts
        self.num_sequences, self.longest = len(lengths), int(lengths.max(initial=0))
        place = np.arange(self.longest)[None, :]
        real = place < lengths[:, None]  # [R, L]: the places that hold a token
        # each real place's flat row, and its index in the flattened grid
        self.rows = torch.from_numpy((starts[:, None] + place)[real]).to(device)
        self.places = torch.from_numpy(np.flatnonzero(real)).to(device)
        self.uniform = bool((lengths == self.longest).all())
        # [R, 1, 1, L]: the keys a query may see (True: attend)
        self.key_mask = torch.from_numpy(real).to(device)[:, None, None, :]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
               head_dim: int, scale: float) -> torch.Tensor:
        """q, k, v: [T, num_heads * head_dim] in the step's row order -> the attention output,
        [T, num_heads * head_dim] in the same order."""
        grid = (self.num_sequences, self.longest, num_heads, head_dim)

        def padded(x: torch.Tensor) -> torch.Tensor:  # -> [R, heads, L, head_dim]
            if self.uniform:
                return x.view(grid).transpose(1, 2)
            out = x.new_zeros((self.num_sequences * self.longest, num_heads * head_dim))
            out.index_copy_(0, self.places, x.index_select(0, self.rows))
            return out.view(grid).transpose(1, 2)

        mask = None if self.uniform else self.key_mask
        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), attn_mask=mask,
                                             scale=scale)
        out = out.transpose(1, 2).reshape(self.num_sequences * self.longest, -1)
        if self.uniform:
            return out
        flat = q.new_empty((q.shape[0], num_heads * head_dim))
        return flat.index_copy_(0, self.rows, out.index_select(0, self.places))
