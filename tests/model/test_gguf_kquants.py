"""K-quant GGUF tensors (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) read through octavo's loader.

The gguf package cannot write K-quants, so this file holds its own reading of the super-block
layouts (256 weights each; sub-block scales, and mins where the type has them, packed beside the
quants) in both directions:
1. random but valid blocks (random bytes, finite f16 super-block scales) come out of the loader
   exactly as the layout decoder below says they should;
2. a simple reference quantizer (nothing optimal: min/max per sub-block, scales rounded up so
   nothing clips) writes real weights, and the loader returns them within that type's error,
   as a fraction of each super-block's range.
"""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q

from octavo.arch_config import ArchConfig
from octavo.model.loader.gguf_weights import iterate_gguf_weights

# per type: (sub-block size, quant bits, scale bits, has mins, byte fields in block order)
TYPES = {
    Q.Q2_K: (16, 2, 4, True, [("scales", 16), ("qs", 64), ("d", 2), ("dmin", 2)]),
    Q.Q3_K: (16, 3, 6, False, [("hmask", 32), ("qs", 64), ("scales", 12), ("d", 2)]),
    Q.Q4_K: (32, 4, 6, True, [("d", 2), ("dmin", 2), ("scales", 12), ("qs", 128)]),
    Q.Q5_K: (32, 5, 6, True, [("d", 2), ("dmin", 2), ("scales", 12), ("qh", 32), ("qs", 128)]),
    Q.Q6_K: (16, 6, 8, False, [("ql", 128), ("qh", 64), ("scales", 16), ("d", 2)]),
}


def _bits(a: np.ndarray, shifts, width: int) -> np.ndarray:
    return (a[..., None, :] >> np.asarray(shifts, np.uint8)[:, None]) & ((1 << width) - 1)


def _scales_k4(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K: 8 six-bit scales and 8 six-bit mins in 12 bytes -> ([nb, 8], [nb, 8])."""
    lo, mid, hi = b[:, 0:4], b[:, 4:8], b[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | (lo >> 6) << 4], 1)
    mn = np.concatenate([mid & 63, (hi >> 4) | (mid >> 6) << 4], 1)
    return sc, mn


def decode(qtype: Q, blocks: np.ndarray) -> np.ndarray:
    """Blocks [nb, bytes] -> weights [nb, 256], read from the layout, in float64."""
    sub, *_, layout = TYPES[qtype]
    nb, f, pos = len(blocks), {}, 0
    for name, size in layout:
        f[name] = blocks[:, pos:pos + size]
        pos += size
    d = f["d"].copy().view(np.float16).astype(np.float64)  # [nb, 1]
    if qtype in (Q.Q2_K, Q.Q3_K):  # 2 halves x 4 shifts of the same 32 bytes
        q = _bits(f["qs"].reshape(nb, 2, 32), [0, 2, 4, 6], 2).astype(np.int64)  # [nb, 2, 4, 32]
    if qtype == Q.Q2_K:
        sc, mn = f["scales"] & 15, f["scales"] >> 4
    elif qtype == Q.Q3_K:
        hbit = _bits(f["hmask"], range(8), 1).reshape(nb, 2, 4, 32)
        q = q - 4 * (1 - hbit.astype(np.int64))
        b = f["scales"]
        low = np.concatenate([b[:, :8] & 15, b[:, :8] >> 4], 1)  # scale k: byte k % 8
        high = _bits(b[:, 8:12], [0, 2, 4, 6], 2).reshape(nb, 16)  # scale k: byte 8 + k % 4
        sc = (low | high << 4).astype(np.int64) - 32
    elif qtype in (Q.Q4_K, Q.Q5_K):
        sc, mn = _scales_k4(f["scales"])
        q = _bits(f["qs"].reshape(nb, 4, 32), [0, 4], 4).astype(np.int64)  # [nb, 4, 2, 32]
        if qtype == Q.Q5_K:
            q = q + 16 * _bits(f["qh"], range(8), 1).reshape(q.shape)
    elif qtype == Q.Q6_K:
        nib = _bits(f["ql"].reshape(nb, 2, 2, 32), [0, 4], 4)  # [nb, half, which, nibble, 32]
        nib = nib.swapaxes(2, 3).reshape(nb, 2, 4, 32)  # quarter = nibble * 2 + which
        high = _bits(f["qh"].reshape(nb, 2, 32), [0, 2, 4, 6], 2)  # [nb, half, quarter, 32]
        q = (nib | high << 4).astype(np.int64) - 32
        sc = f["scales"].view(np.int8).astype(np.int64)
    w = d[:, :, None] * sc[:, :, None] * q.reshape(nb, -1, sub)
    if TYPES[qtype][3]:
        dmin = f["dmin"].copy().view(np.float16).astype(np.float64)
        w = w - dmin[:, :, None] * mn[:, :, None]
    return w.reshape(nb, 256)


def _f16(x: np.ndarray) -> np.ndarray:
    """Round up to f16 (so a scale never shrinks below what the data needs)."""
    return (x * (1 + 2.0 ** -9)).astype(np.float16)


def encode(qtype: Q, x: np.ndarray) -> np.ndarray:
    """A simple quantizer: weights [nb, 256] -> blocks [nb, bytes]."""
    sub, bits, sbits, has_min, layout = TYPES[qtype]
    nb = len(x)
    xs = x.reshape(nb, -1, sub).astype(np.float64)
    top = 2 ** bits - 1 if has_min else 2 ** (bits - 1) - 1  # Q3_K/Q6_K use -top-1..top
    smax = 2 ** sbits - 1 if has_min else 2 ** (sbits - 1) - 1
    f: dict[str, np.ndarray] = {}
    if has_min:
        neg_lo = np.maximum(-xs.min(-1), 0)  # the decoder subtracts dmin * m, m >= 0
        dmin = _f16(neg_lo.max(-1, keepdims=True) / smax)
        dmin64 = dmin.astype(np.float64)
        mn = np.clip(np.ceil(np.divide(neg_lo, dmin64, out=np.zeros_like(neg_lo),
                                       where=dmin64 > 0)), 0, smax)
        lo = -dmin64 * mn
        scale = (xs.max(-1) - lo) / top
    else:
        lo, scale = 0.0, np.abs(xs).max(-1) / top
    d = _f16(scale.max(-1, keepdims=True) / smax)
    d64 = d.astype(np.float64)
    sc = np.clip(np.ceil(np.divide(scale, d64, out=np.zeros_like(scale), where=d64 > 0)), 0, smax)
    step = d64 * sc
    rel = np.divide(xs - np.expand_dims(lo, -1), step[..., None], out=np.zeros_like(xs),
                    where=step[..., None] > 0)
    q = np.clip(np.rint(rel), 0 if has_min else -top - 1, top).astype(np.int64).reshape(nb, 256)
    u8 = np.uint8
    f["d"] = d.view(u8)
    if has_min:
        f["dmin"] = dmin.view(u8)
    if qtype in (Q.Q2_K, Q.Q3_K):
        u = q + 4 if qtype == Q.Q3_K else q
        low = (u & 3).reshape(nb, 2, 4, 32) << np.array([0, 2, 4, 6])[:, None]
        f["qs"] = low.sum(2).reshape(nb, 64).astype(u8)
    if qtype == Q.Q2_K:
        f["scales"] = (sc.astype(np.int64) | mn.astype(np.int64) << 4).astype(u8)
    elif qtype == Q.Q3_K:
        f["hmask"] = ((u >> 2).reshape(nb, 8, 32) << np.arange(8)[:, None]).sum(1).astype(u8)
        s = sc.astype(np.int64) + 32
        high = ((s >> 4).reshape(nb, 4, 4) << np.array([0, 2, 4, 6])[:, None]).sum(1)
        f["scales"] = np.concatenate([(s[:, :8] & 15) | (s[:, 8:] & 15) << 4, high], 1).astype(u8)
    elif qtype in (Q.Q4_K, Q.Q5_K):
        s, m = sc.astype(np.int64), mn.astype(np.int64)
        f["scales"] = np.concatenate([s[:, :4] | (s[:, 4:] >> 4) << 6,
                                      m[:, :4] | (m[:, 4:] >> 4) << 6,
                                      (s[:, 4:] & 15) | (m[:, 4:] & 15) << 4], 1).astype(u8)
        nib = (q & 15).reshape(nb, 4, 2, 32)
        f["qs"] = (nib[:, :, 0] | nib[:, :, 1] << 4).reshape(nb, 128).astype(u8)
        if qtype == Q.Q5_K:
            f["qh"] = ((q >> 4).reshape(nb, 8, 32) << np.arange(8)[:, None]).sum(1).astype(u8)
    elif qtype == Q.Q6_K:
        u = (q + 32).reshape(nb, 2, 4, 32)  # [nb, half, quarter, 32]
        f["ql"] = ((u[:, :, :2] & 15) | (u[:, :, 2:] & 15) << 4).reshape(nb, 128).astype(u8)
        f["qh"] = ((u >> 4) << np.array([0, 2, 4, 6])[:, None]).sum(2).reshape(nb, 64).astype(u8)
        f["scales"] = sc.astype(np.int8).view(u8)
    return np.concatenate([f[name] for name, _ in layout], 1)


def _load(tmp_path, qtype: Q, blocks: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """Write `blocks` as one GGUF tensor of `shape` and read it back through octavo's loader."""
    path = tmp_path / "k.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    raw = blocks.reshape(shape[0], -1)
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ArchConfig(architecture="Qwen2ForCausalLM", vocab_size=8, hidden_size=shape[1],
                     intermediate_size=shape[0], num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=shape[1] // 2, max_position_embeddings=64, gguf_arch="qwen2")
    bits: dict[str, int] = {}
    ((name, got),) = list(iterate_gguf_weights(path, cfg, bits))
    assert name == "model.layers.0.mlp.up_proj.weight" and tuple(got.shape) == shape
    assert bits[name] == int(qtype.name[1])
    return got.numpy()


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
def test_random_blocks_decode_as_the_layout_says(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    shape = (6, 512)
    nb = shape[0] * shape[1] // 256
    blocks = rng.integers(0, 256, (nb, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    pos = 0
    for name, size in TYPES[qtype][4]:
        if name in ("d", "dmin"):  # finite scales of either sign
            blocks[:, pos:pos + 2] = rng.uniform(-0.05, 0.05, (nb, 1)).astype(np.float16).view(
                np.uint8)
        pos += size
    got = _load(tmp_path, qtype, blocks, shape)
    expected = decode(qtype, blocks).reshape(shape)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6 * np.abs(expected).max())
    assert np.abs(expected).max() > 0.1  # the random quants and scales were really used


# Worst error of the reference quantizer, as a fraction of each super-block's span (types with
# mins: max(x, 0) - min(x, 0)) or largest magnitude: half a quant step, where the step is widened
# by rounding the sub-block scale (and min) up to the super-block's scale grid. With 2^b - 1 steps
# and s-bit scales, (1 + 1 / (2^s - 1))^2 / (2 (2^b - 1)); Q3_K/Q6_K: (1 + 1 / smax) / (2 top).
BOUND = {Q.Q2_K: 0.192, Q.Q3_K: 0.174, Q.Q4_K: 0.035, Q.Q5_K: 0.0168, Q.Q6_K: 0.0164}


@pytest.mark.parametrize("qtype", list(TYPES), ids=lambda q: q.name)
def test_round_trip_stays_within_the_type_error(tmp_path, qtype):
    rng = np.random.default_rng(100 + int(qtype))
    shape = (8, 768)
    # rows of very different scales, with an offset so the sub-block mins matter
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3, (shape[0], 1))
         + rng.uniform(-0.5, 0.5, (shape[0], 1))).astype(np.float32)
    blocks = w.reshape(-1, 256)
    np.testing.assert_allclose(decode(qtype, encode(qtype, blocks)), blocks,
                               atol=float(np.ptp(blocks)))  # the encoder's own sanity
    got = _load(tmp_path, qtype, encode(qtype, blocks), shape).reshape(-1, 256)
    span = (np.maximum(blocks.max(1), 0) - np.minimum(blocks.min(1), 0) if TYPES[qtype][3]
            else np.abs(blocks).max(1))[:, None]
    err = np.abs(got - blocks)
    assert (err <= span * BOUND[qtype] + 1e-6).all(), (err / span).max()
    assert err.max() > 0
