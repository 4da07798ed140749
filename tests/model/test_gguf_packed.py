"""GGUF weights kept quantized (octavo/model/quant/gguf.py).

1. Q4_0, Q4_1 and Q4_K codes copied into torch's int4 layout give back the GGUF's own
   dequantization: to float32 rounding in float32, to the bf16 rounding of scale and zero in
   bf16, on random valid blocks (random bytes, finite f16 scales).
2. Q8_0 goes to int8 per 32 inputs: its codes and scales come back exactly from its dequantized
   weights, and octavo's grouped int8 GEMV gives the dense product.
3. A tiny Llama written as a GGUF with Q4_0 (q/k, whose rows llama.cpp permutes), Q4_1, Q4_K and
   Q8_0 tensors: each GGML type's choice is logged once; int8 and the bf16 decode copies agree
   with dense by the top-5 criterion; with only 4-bit types, --quantization int4 in float32 gives
   the dense path's greedy tokens and prompt logprobs; --quantization fp8 on a GGUF is refused.
4. The same exactness through every layout change the loader undoes (GPT-2, GPT-NeoX, Phi-3,
   Mixtral's permuted q/k and stacked experts).
"""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFWriter
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from octavo.arch_config import ArchConfig
from octavo.model.loader.gguf_weights import iterate_gguf_weights
from octavo.model.quant.packed import Int4Packed
from octavo.model.quant.weights import DenseWeights, PackedWeights

NAME = "model.layers.0.mlp.up_proj.weight"


def _random_blocks(qtype: Q, nb: int, seed: int) -> np.ndarray:
    """Random bytes with finite f16 scales (d, and m / dmin where the type has one)."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (nb, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    scales = {Q.Q4_0: 1, Q.Q4_1: 2, Q.Q4_K: 2, Q.Q8_0: 1}[qtype]
    blocks[:, :2 * scales] = rng.uniform(-0.05, 0.05, (nb, scales)).astype(np.float16) \
        .view(np.uint8)
    return blocks


def _load(tmp_path, qtype: Q, blocks: np.ndarray, shape: tuple[int, int]):
    """Write one GGUF tensor and read it back: (dense weight, codes or None)."""
    path = tmp_path / "w.gguf"
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
    codes = {NAME: "int4"} if qtype != Q.Q8_0 else {}
    out = dict(iterate_gguf_weights(path, cfg, codes=codes))
    reference = dequantize(raw, qtype).reshape(shape)
    assert np.array_equal(out[NAME].numpy(), reference)
    stem = NAME.removesuffix("weight")
    parts = [out.get(stem + k) for k in ("gguf_q4", "gguf_q4_scale", "gguf_q4_low")]
    return torch.from_numpy(reference), (None if parts[0] is None else parts)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K], ids=lambda q: q.name)
def test_int4_codes_give_back_the_gguf_weights(tmp_path, qtype):
    shape = (40, 512)  # 40 rows: the kernel's tail block (N % 64) and row padding are used
    nb = shape[0] * shape[1] // {Q.Q4_K: 256}.get(qtype, 32)
    w, (q, scale, low) = _load(tmp_path, qtype, _random_blocks(qtype, nb, int(qtype)), shape)
    assert q.dtype == torch.uint8 and q.shape == shape and int(q.max()) <= 15
    assert scale.shape == low.shape == (shape[0], shape[1] // 32)
    exact = Int4Packed.from_affine(q, scale, low, 32, torch.float32)
    got = exact.dequantize(0, shape[0], torch.float32)
    torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-6 * float(w.abs().max()))
    x = torch.randn(3, shape[1])
    torch.testing.assert_close(exact.matmul(x), x @ w.t(), rtol=1e-4, atol=1e-4)
    # bf16 activations: octavo's kernel keeps the float32 scales, so the weights stay exact;
    # torch's layout (the fallback) rounds scale and zero (8 * scale + low) to bf16, nothing else
    bf16 = Int4Packed.from_affine(q, scale, low, 32, torch.bfloat16)
    torch.testing.assert_close(bf16.dequantize(0, shape[0], torch.float32), got)
    _, scales_zeros = bf16.torch_layout()
    assert scales_zeros.dtype == torch.bfloat16
    sz = scales_zeros[:, :shape[0]].float().transpose(0, 1).repeat_interleave(32, 1)
    rounded = (q.float() - 8) * sz[..., 0] + sz[..., 1]
    bound = ((q.float() - 8).abs() * scale.abs().repeat_interleave(32, 1)
             + (8 * scale + low).abs().repeat_interleave(32, 1)) * 2 ** -8
    assert ((rounded - w).abs() <= bound + 1e-12).all()
    assert (rounded - w).abs().max() > 0  # bf16 did round something
    assert w.abs().max() > 0.1  # the random codes and scales were really used


def test_q8_0_goes_to_int8_per_32_exactly(tmp_path, native_kernels):
    from octavo.model.quant.packed import quantize_int8_grouped

    shape = (48, 256)
    blocks = _random_blocks(Q.Q8_0, shape[0] * shape[1] // 32, 7)
    codes8 = blocks[:, 2:].view(np.int8)  # as llama.cpp writes them: d = absmax / 127 >= 0, so
    codes8[codes8 == -128] = -127  # each block's largest code is +-127 and none is -128
    codes8[:, 5] = np.where(codes8[:, 5] < 0, -127, 127)
    d = blocks[:, :2].view(np.float16)
    d[:] = np.abs(d)
    w, codes = _load(tmp_path, Q.Q8_0, blocks, shape)
    assert codes is None
    packed = quantize_int8_grouped(w, 32, torch.bfloat16)
    assert torch.equal(packed.dequantize(0, shape[0], torch.float32), w)  # code for code
    raw = blocks.reshape(shape[0], -1, 34)  # per block: f16 scale, then 32 int8 codes
    assert torch.equal(packed.q, torch.from_numpy(raw[..., 2:].copy().view(np.int8)
                                                  .reshape(shape)))
    x = torch.randn(3, shape[1]).bfloat16()
    ref = torch.nn.functional.linear(x.float(), w)
    out = packed.matmul(x).float()  # octavo's grouped int8 GEMV
    assert (out - ref).norm() / ref.norm() < 1e-2


def _qtypes(name: str) -> Q | None:
    """The GGML type of each tiny-model tensor: each mapping in use."""
    if not name.startswith("blk.") or not name.endswith(".weight") or "norm" in name:
        return None
    for part, qtype in (("attn_q", Q.Q4_0), ("attn_k", Q.Q4_0), ("attn_v", Q.Q8_0),
                        ("attn_output", Q.Q4_K), ("ffn_gate", Q.Q4_1), ("ffn_up", Q.Q4_1),
                        ("ffn_down", Q.Q8_0)):
        if f".{part}." in name:
            return qtype
    return None


def _write_tiny(path, qtypes, tied: bool = True) -> None:
    import transformers

    from tests.model.gguf_convert import write_gguf

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.08 if p.dim() > 1 else 1 + 0.1 * torch.randn_like(p))
    write_gguf(path, "llama", model, qtypes)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    _write_tiny(path, _qtypes)
    return path


def _generate(path, tokenizer, monkeypatch, tmp_path, **kw):
    from octavo import LLM, SamplingParams

    # the prepared-weights copies of this throwaway file stay out of the user's cache
    monkeypatch.setattr("octavo.model.loader.prepared_cache.cache_dir", lambda: tmp_path)
    prompts = [torch.randint(100, 49000, (n,), generator=torch.Generator().manual_seed(n))
               .tolist() for n in (5, 17, 40)]
    llm = LLM(str(path), tokenizer=str(tokenizer), max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, **kw)
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, prompt_logprobs=0)
    return [o for o in llm.generate(prompts, params, use_tqdm=False)], llm


def _same_tokens_and_prompt_logprobs(a, b) -> None:
    """Equal greedy tokens, prompt logprobs within 1e-4 (the same weights, float32 rounding)."""
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        ours = torch.tensor([lp[t].logprob for lp, t in zip(x.prompt_logprobs[1:],
                                                             x.prompt_token_ids[1:])])
        theirs = torch.tensor([lp[t].logprob for lp, t in zip(y.prompt_logprobs[1:],
                                                              y.prompt_token_ids[1:])])
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4)


def _top5_agree(a, b) -> None:
    """Tokens equal, or at the first divergence each side's pick is in the other's top 5."""
    for x, y in zip(a, b):
        for j, (p, q) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids)):
            if p != q:
                assert p in y.outputs[0].logprobs[j] and q in x.outputs[0].logprobs[j]
                break


def test_tiny_gguf_int4_and_int8_agree_with_dense(tiny_gguf, smollm_oracle_folder, monkeypatch,
                                             tmp_path, caplog):
    from octavo.model.quant.gguf import GGUFMethod
    from octavo.model.quant.packed import Int8Grouped

    dense, _ = _generate(tiny_gguf, smollm_oracle_folder, monkeypatch, tmp_path,
                         dtype="float32")
    with caplog.at_level(logging.INFO, logger="octavo.model.quant.gguf"):
        _, llm = _generate(tiny_gguf, smollm_oracle_folder, monkeypatch, tmp_path,
                              dtype="float32", quantization="int4")
    model = llm.engine.client.core.executor.worker.runner.model
    for lin in (model.model.layers[1].self_attn.qkv_proj, model.model.layers[1].mlp.down_proj):
        assert isinstance(lin.quant_method, GGUFMethod) and not hasattr(lin, "weight")
        assert isinstance(lin.weights, PackedWeights)  # no dense copy
        assert isinstance(lin.weights.packed, Int4Packed)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("GGUF ")]
    assert sorted(lines) == sorted([
        "GGUF Q4_0 weights -> int4 group 32, its codes, scales and offsets copied (exact)",
        "GGUF Q8_0 weights -> int4 group 32, re-quantized (min/max per 32) from the dequantized "
        "weights",
        "GGUF Q4_K weights -> int4 group 32, its codes, scales and offsets copied (exact)",
        "GGUF Q4_1 weights -> int4 group 32, its codes, scales and offsets copied (exact)"]), lines
    del llm
    int8, llm = _generate(tiny_gguf, smollm_oracle_folder, monkeypatch, tmp_path,
                          dtype="float32", quantization="int8")
    model = llm.engine.client.core.executor.worker.runner.model
    assert isinstance(model.model.layers[0].mlp.gate_up_proj.weights.packed, Int8Grouped)
    _top5_agree(int8, dense)  # (int4 re-quantizes the Q8_0 tensors: the next test is exact)


def test_tiny_gguf_exact_int4_layers_give_dense_logprobs(tiny_gguf, smollm_oracle_folder,
                                                        monkeypatch, tmp_path):
    """Every quantized tensor Q4_0/Q4_1/Q4_K: the int4 path is the dense one to float32
    rounding, so greedy tokens are equal and prompt logprobs agree to 1e-4."""
    path = tmp_path / "tiny-q4.gguf"
    four = {Q.Q8_0: Q.Q4_1}
    _write_tiny(path, lambda n: four.get(_qtypes(n), _qtypes(n)))
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32")
    int4, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32",
                        quantization="int4")
    _same_tokens_and_prompt_logprobs(int4, dense)


@pytest.mark.parametrize("dense_prefill", [False, True])
def test_tiny_gguf_bf16_packed_weights_agree_with_dense(tiny_gguf, smollm_oracle_folder,
                                                        monkeypatch, tmp_path, dense_prefill):
    """The default keeps the GGUF's codes alone (prompts of 17 and 40 tokens take dequantized
    tiles past the int4 kernel's rows on AMX); --dense-prefill-weights keeps them as the dense
    weights' copies for small batches."""
    from octavo.model.quant.packed import Int8Grouped

    fast, llm = _generate(tiny_gguf, smollm_oracle_folder, monkeypatch, tmp_path,
                          dtype="bfloat16", dense_prefill_weights=dense_prefill)
    layer = llm.engine.client.core.executor.worker.runner.model.model.layers[0]
    kind = DenseWeights if dense_prefill else PackedWeights
    field = "small_batch" if dense_prefill else "packed"
    assert isinstance(layer.self_attn.qkv_proj.weights, kind)
    qkv = getattr(layer.self_attn.qkv_proj.weights, field)  # widest: v (Q8_0)
    assert isinstance(qkv, Int4Packed) and qkv.bits == 8 or isinstance(qkv, Int8Grouped)
    assert isinstance(getattr(layer.self_attn.o_proj.weights, field), Int4Packed)  # Q4_K
    assert isinstance(getattr(layer.mlp.gate_up_proj.weights, field), Int4Packed)  # Q4_1
    dense, _ = _generate(tiny_gguf, smollm_oracle_folder, monkeypatch, tmp_path,
                         dtype="bfloat16", decode_weights="none")
    _top5_agree(fast, dense)


def test_untied_lm_head_is_packed_only_with_quantization(smollm_oracle_folder, monkeypatch,
                                                         tmp_path):
    """An untied Q8_0 output.weight with --quantization int8 (bf16): the head keeps only its
    int8 copy, used for every batch (prompt logprobs: 40 rows), and agrees with dense bf16."""
    from octavo.model.quant.packed import Int8Grouped

    path = tmp_path / "tiny-untied.gguf"
    _write_tiny(path, lambda n: Q.Q8_0 if n == "output.weight" else _qtypes(n), tied=False)
    packed, llm = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path,
                            dtype="bfloat16", quantization="int8")
    head = llm.engine.client.core.executor.worker.runner.model.lm_head
    assert not hasattr(head, "weight") and isinstance(head.weights, PackedWeights)
    assert isinstance(head.weights.packed, Int8Grouped)
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="bfloat16",
                         decode_weights="none")
    _top5_agree(packed, dense)
    assert len(packed[2].prompt_logprobs) == 40


def test_fp8_on_a_gguf_is_refused(tiny_gguf):
    from octavo.model.quant.gguf import GGUFPlan, gguf_plan

    with pytest.raises(ValueError, match="quantization='fp8' is not available for a GGUF"):
        gguf_plan("fp8", "auto", torch.bfloat16)
    with pytest.raises(ValueError, match="must be int4 or int8"):
        GGUFPlan("int2", torch.bfloat16)
    assert gguf_plan(None, "none", torch.bfloat16) is None
    assert not gguf_plan(None, "auto", torch.float32).keep_dense  # the codes alone by default
    assert gguf_plan(None, "auto", torch.float32, dense_prefill=True).keep_dense
    assert gguf_plan(None, "auto", torch.float16) is None


@pytest.mark.parametrize("name", ["gpt2", "gptneox-sequential", "phi3-longrope-partial",
                                  "mixtral", "glm4"])
def test_every_layout_keeps_its_codes_in_place(tmp_path, smollm_oracle_folder, monkeypatch,
                                               name):
    """Each architecture's row reorderings (GPT-NeoX's q/k/v regrouping, Mixtral's llama q/k
    permutation, GLM-4's pairwise-RoPE rows reordered at load), GPT-2's [out, in] Conv1D codes,
    Phi-3's one qkv tensor and stacked MoE experts: with every block weight Q4_0, int4 in
    float32 equals the dense path."""
    from tests.model.gguf_convert import write_gguf
    from tests.model.test_gguf_archs import CASES, _build

    def q4(gguf_name: str) -> Q | None:  # routers and 1-D tensors stay float32
        return Q.Q4_0 if gguf_name.startswith("blk.") and gguf_name.endswith(".weight") \
            and "norm" not in gguf_name and "ffn_gate_inp" not in gguf_name else None

    path = tmp_path / f"{name}.gguf"
    write_gguf(path, CASES[name][0], _build(name), q4)
    dense, _ = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32")
    int4, llm = _generate(path, smollm_oracle_folder, monkeypatch, tmp_path, dtype="float32",
                          quantization="int4")
    model = llm.engine.client.core.executor.worker.runner.model
    assert any(isinstance(getattr(getattr(m, "weights", None), "packed", None), Int4Packed)
               for m in model.modules())
    moe = [m for m in model.modules() if hasattr(m, "quantize_experts")]
    assert all(m.expert_linears is not None for m in moe)  # experts packed too (one Linear each)
    _same_tokens_and_prompt_logprobs(int4, dense)


@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def test_int8_codes_are_the_files_weights_bit_for_bit(name):
    """Q8_0, Q5_0 and Q6_K tensors kept as int8 codes and scales (no re-quantizing), and Q5_0
    ones as 5-bit affine codes: codes times scales (plus offsets) are gguf's own
    dequantization, bit for bit, for every such type in the file."""
    import numpy as np
    from gguf.quants import dequantize

    from octavo.model.quant.ggml_codes import affine_codes, int8_codes
    from octavo.model.quant.gguf import INT8_EXACT
    from octavo.model_files import open_gguf
    from octavo.model_source import pull

    seen = set()
    for t in open_gguf(pull(name)).tensors:
        if t.tensor_type not in INT8_EXACT or t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        rows = int(np.prod([int(d) for d in t.shape[1:]]))
        raw = np.asarray(t.data).reshape(rows, -1)[:64]
        reference = dequantize(raw, t.tensor_type).reshape(64, -1)
        q, scale = int8_codes(t.tensor_type, raw)
        group = q.shape[1] // scale.shape[1]
        assert group == (16 if t.tensor_type == 14 else 32)
        w = (q.astype(np.float32).reshape(64, -1, group) * scale[..., None]).reshape(64, -1)
        assert np.array_equal(w, reference), t.name
        if t.tensor_type == Q.Q5_0:
            q, scale, low = affine_codes(t.tensor_type, raw)
            assert q.max() == 31
            w = q.astype(np.float32).reshape(64, -1, 32) * scale[..., None] + low[..., None]
            assert np.array_equal(w.reshape(64, -1), reference), t.name
    assert len(seen) >= 2
