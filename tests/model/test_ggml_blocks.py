"""Q5_0 and Q6_K weights kept as the GGUF's blocks (octavo/model/quant/ggml_blocks.py,
csrc/ggml_blocks.h).

1. On random valid blocks, the C++ kernels' dense rows are gguf's own dequantization bit for bit
   in float32; the GEMV (1-64 rows) and the tiles (more) give exactly what the int8 codes of the
   same tensor give (Int8Grouped), in float32 and bf16, and the float64 product to float32
   rounding; an embedding's row lookup and the numpy reference (no C++ kernels) agree.
2. The loader yields a tensor's raw bytes for the "blocks" form.
3. A tiny Llama GGUF with Q5_0 and Q6_K layers and a Q5_0 embedding loads them as blocks (the
   plan is inspectable), takes the file's bytes, and generates in float32 what the dense
   weights generate.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from octavo.kernels import fused
from octavo.model.quant.ggml_blocks import BLOCK_KINDS, Q5_0Blocks, Q6_KBlocks, int8_codes
from octavo.model.quant.packed import Int8Grouped

_D_BYTES = {Q.Q5_0: slice(0, 2), Q.Q6_K: slice(208, 210)}  # each block's f16 scale d


def _random_rows(qtype: Q, rows: int, k: int, seed: int) -> np.ndarray:
    """Random bytes [rows, row bytes] with a finite f16 d in every block."""
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, k // block, size), dtype=np.uint8)
    raw[..., _D_BYTES[qtype]] = rng.uniform(-0.02, 0.02, (rows, k // block, 1)) \
        .astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q6_K], ids=lambda q: q.name)
def test_blocks_compute_what_their_int8_codes_compute(qtype, native_kernels):
    rows, k = 72, 768  # 72 output rows: a partial chunk of the GEMV's 64-row blocks
    raw = _random_rows(qtype, rows, k, int(qtype))
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(rows, k))
    assert reference.abs().max() > 0.1  # the random codes and scales were really used
    q, scale = (torch.from_numpy(np.ascontiguousarray(a)) for a in int8_codes(qtype, raw))
    for dtype in (torch.float32, torch.bfloat16):
        blocks = BLOCK_KINDS[qtype](torch.from_numpy(raw), dtype)
        assert (blocks.out_features, blocks.in_features) == (rows, k)
        codes = Int8Grouped(q, scale, dtype)
        assert torch.equal(blocks.dequantize(0, rows, torch.float32), reference)
        assert torch.equal(blocks.dequantize(5, 40, dtype), reference[5:40].to(dtype))
        for m in (1, 3, 8, 13, 64, 100):  # GEMV 8 rows at a time, then dense tiles
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
            got = blocks.matmul(x)
            assert got.dtype == dtype and got.shape == (m, rows)
            assert torch.equal(got, codes.matmul(x)), (dtype, m)
            if dtype == torch.float32:
                exact = (x.double() @ reference.double().t()).float()
                torch.testing.assert_close(got, exact, rtol=1e-5,
                                               atol=1e-6 * float(exact.abs().max()))
        ids = torch.tensor([71, 0, 33, 33])
        assert torch.equal(blocks.rows(ids), reference[ids].to(dtype))


@pytest.mark.parametrize("qtype", [Q.Q5_0, Q.Q6_K], ids=lambda q: q.name)
def test_reference_dequantization_without_the_kernels(qtype, monkeypatch):
    raw = _random_rows(qtype, 20, 512, 3)
    reference = torch.from_numpy(dequantize(raw, qtype).reshape(20, 512))
    monkeypatch.setattr(fused, "_native", None)
    blocks = BLOCK_KINDS[qtype](torch.from_numpy(raw), torch.float32)
    assert torch.equal(blocks.dequantize(2, 9, torch.float32), reference[2:9])
    x = torch.randn(2, 512)
    torch.testing.assert_close(blocks.matmul(x), x @ reference.t(), rtol=1e-5, atol=1e-5)


def test_blocks_must_be_whole():
    with pytest.raises(ValueError, match="whole blocks of 22 bytes"):
        Q5_0Blocks(torch.zeros(4, 23, dtype=torch.uint8), torch.float32)
    with pytest.raises(ValueError, match="Q6_K"):
        Q6_KBlocks(torch.zeros(4, 210), torch.float32)  # float bytes


def test_loader_yields_the_raw_blocks(tmp_path):
    from gguf import GGUFWriter

    from octavo.arch_config import ArchConfig
    from octavo.model.loader.gguf_weights import iterate_gguf_weights

    raw = _random_rows(Q.Q6_K, 48, 512, 9)
    path = tmp_path / "w.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    writer.add_tensor("blk.0.ffn_up.weight", raw, raw_shape=raw.shape, raw_dtype=Q.Q6_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    cfg = ArchConfig(architecture="Qwen2ForCausalLM", vocab_size=8, hidden_size=512,
                     intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=2,
                     head_dim=256, max_position_embeddings=64, gguf_arch="qwen2")
    name = "model.layers.0.mlp.up_proj.weight"
    out = dict(iterate_gguf_weights(path, cfg, codes={name: "blocks"}, dense_too=False))
    assert list(out) == ["model.layers.0.mlp.up_proj.gguf_blocks"]
    got = out["model.layers.0.mlp.up_proj.gguf_blocks"]
    assert got.dtype == torch.uint8 and torch.equal(got[:], torch.from_numpy(raw))


def _qtypes(name: str) -> Q | None:
    """Q5_0 everywhere but the MLP's down projection (Q6_K) and the norms."""
    if name == "token_embd.weight":
        return Q.Q5_0
    if not name.startswith("blk.") or "norm" in name:
        return None
    return Q.Q6_K if ".ffn_down." in name else Q.Q5_0


def test_tiny_gguf_keeps_q5_0_and_q6_k_blocks(tmp_path, smollm_oracle_folder, monkeypatch,
                                              native_kernels):
    from tests.model.test_gguf_packed import _generate, _write_tiny

    path = tmp_path / "tiny-q5.gguf"
    _write_tiny(path, _qtypes)
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32",
                         decode_weights="none")
    blocks, llm = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32")
    model = llm.engine.client.core.executor.worker.runner.model
    kinds = {name: type(m.weights.packed).__name__ for name, m in model.named_modules()
             if hasattr(getattr(m, "weights", None), "packed")}
    assert kinds["model.layers.0.self_attn.qkv_proj"] == "Q5_0Blocks"
    assert kinds["model.layers.1.mlp.gate_up_proj"] == "Q5_0Blocks"
    assert kinds["model.layers.1.mlp.down_proj"] == "Q6_KBlocks"
    assert kinds["model.embed_tokens"] == kinds["lm_head"] == "Q5_0Blocks"  # tied
    from octavo.model.loader.weights_plan import weight_bytes

    held = weight_bytes(model)
    assert set(held) == {"q5_0", "q6_k", "other"}
    assert sum(held.values()) <= 1.02 * path.stat().st_size  # the file's bytes, not int8's
    for a, b in zip(blocks, dense):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        ours = torch.tensor([lp[t].logprob for lp, t in zip(a.prompt_logprobs[1:],
                                                             a.prompt_token_ids[1:])])
        theirs = torch.tensor([lp[t].logprob for lp, t in zip(b.prompt_logprobs[1:],
                                                              b.prompt_token_ids[1:])])
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)
