"""GGML's block formats decoded: a quantized GGUF tensor's raw blocks [rows, row bytes] turned into
integer codes and scales, the forms octavo's packed weights keep (quant/gguf.py): unsigned affine
codes (Q4_0, Q4_1, Q4_K, and 5- and 8-bit Q5_0 and Q8_0: w = scale * q + offset per 32 inputs)
for octavo's int4 layout, signed int8 codes (Q8_0, Q5_0, Q6_K: w = scale * q per 32 or 16) for
its grouped int8 kernel, and MXFP4's e2m1 codes and e8m0 scales for its microscaled weight."""
from __future__ import annotations

import numpy as np

from octavo.model.quant.ggml_types import GGMLType as Q


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def affine_codes(qtype: Q, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Raw blocks [rows, row bytes] of a Q4_0/Q4_1/Q4_K/Q5_0/Q8_0 tensor -> codes [rows, K]
    uint8 (0..15, 0..31 for Q5_0, 0..255 for Q8_0), scale and offset [rows, K / 32] float32,
    with w = scale * q + offset."""
    rows = data.shape[0]
    if qtype in (Q.Q5_0, Q.Q8_0):
        q, d = int8_codes(qtype, data)  # signed codes and d
        shift = 16 if qtype == Q.Q5_0 else 128
        return (q.astype(np.int16) + shift).astype(np.uint8), d, -shift * d
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


def mx_codes(qtype: Q, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw blocks [rows, row bytes] of an MXFP4 tensor (per 32 weights: an e8m0 scale byte, then
    16 bytes whose byte j holds weight j in its low nibble and j + 16 in its high one) -> e2m1
    codes packed two a byte in the OCP order (the even weight in the low nibble) [rows, K / 2]
    and the scale bytes [rows, K / 32], as quant/microscaled.py keeps them."""
    if qtype != Q.MXFP4:
        raise ValueError(f"mx_codes takes MXFP4 blocks, got {qtype.name}")
    rows = data.shape[0]
    b = data.reshape(rows, -1, 17)
    qs = b[..., 1:]
    q = np.concatenate([qs & 15, qs >> 4], -1)  # [rows, nb, 32]: weights in order
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    return packed.reshape(rows, -1), np.ascontiguousarray(b[..., 0])
