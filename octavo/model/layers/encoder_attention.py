"""Bidirectional attention of an encoder (BERT and its kin): every token of a sequence attends to
every other (or, in a ModernBERT local layer, to those within a window on either side), none
to another sequence's. An encoder's requests come whole into one step and keep no KV cache, so
a step's sequences are padded into one batch once (`EncoderBatch`), and each layer runs one
fused attention over it with the padding masked out."""
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
        self._window_masks: dict[int, torch.Tensor] = {}

    def _mask(self, window: int | None) -> torch.Tensor | None:
        """None (every key), or the keys each query may see: real ones, within `window`
        places on either side where one is given."""
        if window is None or window + 1 >= self.longest:
            return None if self.uniform else self.key_mask
        if window not in self._window_masks:
            place = torch.arange(self.longest, device=self.key_mask.device)
            near = (place[:, None] - place[None, :]).abs() <= window  # [L, L]
            self._window_masks[window] = self.key_mask & near[None, None]
        return self._window_masks[window]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int,
               head_dim: int, scale: float, window: int | None = None) -> torch.Tensor:
        """q, k, v: [T, num_heads * head_dim] in the step's row order -> the attention output,
        [T, num_heads * head_dim] in the same order. `window`: a query sees only the keys at
        most this many places away."""
        grid = (self.num_sequences, self.longest, num_heads, head_dim)

        def padded(x: torch.Tensor) -> torch.Tensor:  # -> [R, heads, L, head_dim]
            if self.uniform:
                return x.view(grid).transpose(1, 2)
            out = x.new_zeros((self.num_sequences * self.longest, num_heads * head_dim))
            out.index_copy_(0, self.places, x.index_select(0, self.rows))
            return out.view(grid).transpose(1, 2)

        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v),
                                             attn_mask=self._mask(window), scale=scale)
        out = out.transpose(1, 2).reshape(self.num_sequences * self.longest, -1)
        if self.uniform:
            return out
        flat = q.new_empty((q.shape[0], num_heads * head_dim))
        return flat.index_copy_(0, self.rows, out.index_select(0, self.places))
