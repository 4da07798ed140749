"""The fp8 (e4m3) KV cache: written with per-layer scales, read by the C++ decode kernel and by
the PyTorch reference, both against attention over the dequantized cache."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo.kernels import fused
from octavo.kernels.paged_attention import build_plan, paged_attention, step_layout


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("dim", [64, 8])  # 64: the kernel's AVX-512 path; 8: its scalar loops
def test_fp8_cache_matches_attention_over_dequantized_values(native_kernels, native, dim):
    fused.enable_native(native)
    heads, kv_heads, block_size, num_blocks = 6, 2, 16, 24
    k_scale, v_scale = 0.05, 0.2
    seq_lens = np.array([1, 17, 60, 33])
    table = np.random.default_rng(0).permutation(num_blocks)[:4 * 4].reshape(4, 4)
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, dim, dtype=torch.float8_e4m3fn)
    ctx = build_plan(step_layout(seq_lens, seq_lens), table, block_size)  # every position written
    k = torch.randn(int(seq_lens.sum()), kv_heads, dim) * 3  # some beyond 448 * k_scale: saturate
    v = torch.randn(int(seq_lens.sum()), kv_heads, dim)
    fused.write_kv(cache, k, v, ctx.slot_mapping, k_scale, v_scale)
    stored_k = cache[0].view(-1, kv_heads, dim)[ctx.slot_mapping].float()
    expect_k = (k / k_scale).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    assert torch.equal(stored_k, expect_k)
    # The same attention over a float32 cache holding the dequantized values.
    dense = cache.float() * torch.tensor([k_scale, v_scale]).view(2, 1, 1, 1, 1)
    q = torch.randn(4, heads, dim)
    plan = build_plan(step_layout(np.ones(4, np.int64), seq_lens), table, block_size,
                      native_decode=native)
    assert (plan.decode is not None) == native
    out = paged_attention(q, cache, plan, dim ** -0.5, None, k_scale, v_scale)
    ref = paged_attention(q, dense, build_plan(step_layout(np.ones(4, np.int64), seq_lens), table,
                                               block_size), dim ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5, rtol=1e-4), (out - ref).abs().max()


def test_kv_cache_dtype_is_validated():
    from octavo.config import CacheConfig

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheConfig(kv_cache_dtype="int8")


def test_engine_decodes_with_an_fp8_cache(tmp_path, smollm_oracle_folder, native_kernels):
    """A tiny random Llama decoding 24 tokens through the C++ kernel over an fp8 cache agrees
    with the float32 cache: equal tokens until a step where each side's token is in the
    other's top 3."""
    from octavo import LLM, SamplingParams
    from tests.model.test_quant_checkpoints import _random_model, _save_dense

    _save_dense(_random_model("llama"), tmp_path, smollm_oracle_folder)
    prompt = torch.randint(100, 49000, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=3)
    outs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_dtype=kv, max_model_len=128,
                  kv_cache_memory=4 << 20)
        outs[kv] = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    ref, fp8 = outs["auto"], outs["fp8_e4m3"]
    first_diff = next((i for i, (a, b) in enumerate(zip(ref.token_ids, fp8.token_ids)) if a != b),
                      None)
    if first_diff is not None:  # past a divergence the contexts differ; check that step only
        assert fp8.token_ids[first_diff] in ref.logprobs[first_diff]
        assert ref.token_ids[first_diff] in fp8.logprobs[first_diff]
    assert first_diff is None or first_diff >= 4, (ref.token_ids, fp8.token_ids)
