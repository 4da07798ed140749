"""GGML's block formats: a quantized GGUF tensor's raw blocks decoded into integer codes and
scales (int4_codes, int8_codes: what the loader turns Q4_0/Q4_1/Q4_K and Q8_0/Q5_0/Q6_K tensors
into), and Q5_0 / Q6_K weights kept as the file's blocks (GGMLBlocks).

The 5- and 6-bit types as int8 codes took 8.5 and 10 bits a weight against the file's 5.5 and
6.56: Qwen2.5-Coder-0.5B's Q4_K_M weights were 1.29x the file, and a decode step read that many
more bytes than llama.cpp. As blocks they take the file's bytes, and the C++ kernels
(csrc/ggml_blocks.h) decode each weight row into the same int8 codes and scales on the fly, so
the products are those of the int8 codes.
"""
from __future__ import annotations

import numpy as np
import torch

from octavo.kernels import fused
from octavo.model.quant.ggml_types import GGMLType as Q
from octavo.model.quant.packed import PackedWeight


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def int4_codes(qtype: Q, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw blocks [rows, row bytes] of a Q4_0/Q4_1/Q4_K tensor -> codes [rows, K] uint8,
    scale and offset [rows, K / 32] float32, with w = scale * q + offset."""
    rows = data.shape[0]
    size = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144}[qtype]
    b = data.reshape(rows, -1, size)
    if qtype == Q.Q4_K:
        d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # [rows, nb, 1]
        lo, mid, hi = b[..., 4:8], b[..., 8:12], b[..., 12:16]
        sc = np.concatenate([lo & 63, (hi & 15) | (lo >> 6) << 4], -1)  # [rows, nb, 8]
        mn = np.concatenate([mid & 63, (hi >> 4) | (mid >> 6) << 4], -1)
        qs = b[..., 16:].reshape(rows, -1, 4, 1, 32)  # 32 bytes: sub-blocks 2c (low), 2c + 1
        q = np.concatenate([qs & 15, qs >> 4], 3)  # [rows, nb, 4, 2, 32]
        scale, low = d * sc, -(dmin * mn)
    else:
        d = _f16(b[..., 0:2])
        qs = b[..., size - 16:].reshape(rows, -1, 1, 16)  # byte j: weights j (low), j + 16
        q = np.concatenate([qs & 15, qs >> 4], 2)
        scale = d
        low = _f16(b[..., 2:4]) if qtype == Q.Q4_1 else -8 * d
    return q.reshape(rows, -1), scale.reshape(rows, -1), low.reshape(rows, -1)


def int8_codes(qtype: Q, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks [rows, row bytes] of a Q8_0/Q5_0/Q6_K tensor -> codes [rows, K] int8 and
    scales [rows, K / group] float32 (group 32, or 16 for Q6_K), with w = scale * code exactly
    as ggml dequantizes (Q6_K's scale d * sc first, then times the code)."""
    rows = data.shape[0]
    size = {Q.Q8_0: 34, Q.Q5_0: 22, Q.Q6_K: 210}[qtype]
    b = data.reshape(rows, -1, size)
    if qtype == Q.Q8_0:
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8)
        return q.reshape(rows, -1), _f16(b[..., 0:2]).reshape(rows, -1)
    if qtype == Q.Q5_0:
        qh = np.ascontiguousarray(b[..., 2:6]).view("<u4")  # [rows, nb, 1]: bit j of weight j
        bit = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4  # [rows, nb, 32]
        qs = b[..., 6:22]
        low = np.concatenate([qs & 15, qs >> 4], -1)  # byte j: weights j (low) and j + 16
        q = (low | bit).astype(np.int8) - 16
        return q.reshape(rows, -1), _f16(b[..., 0:2]).reshape(rows, -1)
    # Q6_K, 256 weights in two halves of 128: ql [2][64], qh [2][32], 16 int8 scales, d. Weight
    # 32 i + l of a half (i < 4, l < 32) is the low (i < 2) or high nibble of ql byte
    # 32 (i % 2) + l, with bits 2 i, 2 i + 1 of qh byte l above it, scaled by
    # d * sc[8 h + 2 i + l / 16].
    ql = b[..., :128].reshape(rows, -1, 2, 2, 32)  # [.., half, i % 2, l]
    qh = b[..., 128:192].reshape(rows, -1, 2, 1, 32)
    sc = b[..., 192:208].view(np.int8).astype(np.float32).reshape(rows, -1, 16)
    d = _f16(b[..., 208:210])  # [rows, nb, 1]
    nib = np.concatenate([ql & 15, ql >> 4], 3)  # [rows, nb, half, i, l]
    hi = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)) & 3
    q = (nib | (hi << 4)).astype(np.int8) - 32
    return q.reshape(rows, -1), (d * sc).reshape(rows, -1)


class GGMLBlocks(PackedWeight):
    """A weight as a GGUF's Q5_0 or Q6_K blocks, [N, row bytes] uint8 in the file's layout
    (each row its K / block_weights blocks). Batches of up to 64 rows run the C++ GEMV on the
    blocks, larger ones (or any without the C++ kernels) dense tiles of the decoded rows."""

    qtype: Q
    name: str  # the kernels' name of the type
    block_weights: int
    block_bytes: int
    dense_rows = 64

    def __init__(self, blocks: torch.Tensor, dtype: torch.dtype) -> None:
        n, row_bytes = blocks.shape
        if blocks.dtype != torch.uint8 or row_bytes % self.block_bytes:
            raise ValueError(f"{self.qtype.name} weights must be whole blocks of "
                             f"{self.block_bytes} bytes a row, got {tuple(blocks.shape)} "
                             f"{blocks.dtype}")
        self.blocks, self.dtype, self.perm = blocks.contiguous(), dtype, None
        self.out_features = n
        self.in_features = row_bytes // self.block_bytes * self.block_weights

    def tensors(self) -> dict[str, torch.Tensor]:
        return {"blocks": self.blocks, "dtype": torch.zeros(1, dtype=self.dtype)}

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> GGMLBlocks:
        return cls(t["blocks"], t["dtype"].dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if not (fused.native_active(x) and x.dtype in (torch.bfloat16, torch.float32)):
            return super().tiled_matmul(x)
        return super().matmul(x)

    def kernel_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fused.ggml_gemv(x, self.blocks, self.name)

    def tiled_matmul(self, x: torch.Tensor) -> torch.Tensor:
        return fused.ggml_tiled_linear(x, self.blocks, self.name)

    def dequantize(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        if fused.native_ready() and dtype in (torch.bfloat16, torch.float32):
            return fused.ggml_dequantize(self.blocks, self.name, start, end - start, dtype)
        q, scale = (torch.from_numpy(a) for a in
                    int8_codes(self.qtype, self.blocks[start:end].numpy()))
        group = self.in_features // scale.shape[1]
        w = q.float().view(end - start, -1, group) * scale[..., None]
        return w.view(end - start, -1).to(dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        picked = type(self)(self.blocks.index_select(0, ids), self.dtype)
        return picked.dequantize(0, ids.shape[0], self.dtype)


class Q5_0Blocks(GGMLBlocks):
    qtype, name, block_weights, block_bytes = Q.Q5_0, "q5_0", 32, 22


class Q6_KBlocks(GGMLBlocks):
    qtype, name, block_weights, block_bytes = Q.Q6_K, "q6_k", 256, 210


BLOCK_KINDS: dict[Q, type[GGMLBlocks]] = {Q.Q5_0: Q5_0Blocks, Q.Q6_K: Q6_KBlocks}
