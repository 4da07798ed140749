"""GGUF files written with the gguf package's own writer, read back through octavo's loader.

1. Each quantization type gguf can write (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) round-trips
   to within that type's step of the original weights, with the right shape, name and source bits.
2. Tiny Gemma 3 and Qwen3 models converted to GGUF the way llama.cpp lays them out (gguf_convert.py:
   Gemma's norms stored as 1 + w, its pre-MLP norm named ffn_norm) give the same logits as
   transformers. The other architectures are in test_gguf_archs.py, K-quants in
   test_gguf_kquants.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import quantize

from octavo.arch_config import ArchConfig
from octavo.model.loader.gguf_weights import iterate_gguf_weights
from tests.model.gguf_convert import write_gguf

# Worst error per element, as a fraction of its block's largest magnitude.
STEP = {Q.F32: 0.0, Q.F16: 1e-3, Q.BF16: 8e-3, Q.Q8_0: 1 / 127, Q.Q5_0: 1 / 16, Q.Q5_1: 1 / 16,
        Q.Q4_0: 1 / 8, Q.Q4_1: 1 / 8}
BITS = {Q.F32: 32, Q.F16: 16, Q.BF16: 16, Q.Q8_0: 8, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_0: 4, Q.Q4_1: 4}


def _cfg(arch: str) -> ArchConfig:
    return ArchConfig(architecture="x", vocab_size=8, hidden_size=64, intermediate_size=96,
                      num_layers=1, num_heads=2, num_kv_heads=2, head_dim=32,
                      max_position_embeddings=64, gguf_arch=arch)


@pytest.mark.parametrize("qtype", list(STEP), ids=lambda q: q.name)
def test_quant_type_round_trips_within_its_step(tmp_path, qtype):
    rng = np.random.default_rng(int(qtype))
    w = (rng.standard_normal((96, 64)) * rng.uniform(0.01, 3, (96, 1))).astype(np.float32)
    path = tmp_path / "w.gguf"
    writer = GGUFWriter(str(path), "qwen2")
    q = quantize(w, qtype)
    writer.add_tensor("blk.0.ffn_up.weight", q, raw_shape=q.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    bits: dict[str, int] = {}
    ((name, got),) = list(iterate_gguf_weights(path, _cfg("qwen2"), bits))
    assert name == "model.layers.0.mlp.up_proj.weight" and got.shape == (96, 64)
    assert bits[name] == BITS[qtype]
    block = np.abs(w.reshape(96, -1, 32)).max(-1, keepdims=True)  # 32-wide blocks
    err = np.abs(got.numpy().reshape(96, -1, 32) - w.reshape(96, -1, 32))
    assert (err <= block * STEP[qtype] + 1e-7).all(), (err / block).max()
    if qtype != Q.F32:
        assert err.max() > 0  # a lossy type really went through its quantization


@pytest.mark.parametrize("arch", ["gemma3", "qwen3"])
def test_tiny_gguf_matches_transformers(tmp_path, smollm_oracle_folder, monkeypatch, arch):
    import transformers

    from octavo import LLM, SamplingParams

    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
                  rms_norm_eps=1e-6, tie_word_embeddings=arch == "gemma3")
    if arch == "gemma3":  # what llama.cpp assumes for gemma3: 5 local layers, then a global one
        config = transformers.Gemma3TextConfig(
            num_hidden_layers=6, sliding_window=24, query_pre_attn_scalar=32, **common)
        model = transformers.Gemma3ForCausalLM(config)
    else:
        config = transformers.Qwen3Config(num_hidden_layers=2, **common)
        model = transformers.Qwen3ForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.08 if p.dim() > 1 else 0.1) + (p.dim() == 1) * 0.0)
    model.eval()
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(path, arch, model)
    # the prepared-weights copy of this throwaway file stays out of the user's cache
    monkeypatch.setattr("octavo.model.loader.prepared_cache.cache_dir", lambda: tmp_path)
    prompt = torch.randint(100, 49000, (100,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    llm = LLM(str(path), tokenizer=str(smollm_oracle_folder), dtype="float32", max_model_len=256,
              kv_cache_memory=16 << 20, max_num_batched_tokens=48)
    assert llm.engine.arch.architecture == {"gemma3": "Gemma3ForCausalLM",
                                            "qwen3": "Qwen3ForCausalLM"}[arch]
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    expected = ref[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, expected, atol=1e-4), (ours - expected).abs().max()


def test_tensor_types_are_parsed_once_per_file(smollm_gguf, tmp_path, monkeypatch):
    """GGUFReader parses the whole vocabulary (about 2 s for SmolLM2): a start that reads
    prepared weights takes the tensor types from the cache instead."""
    from octavo.arch_config import read_arch_config
    from octavo.model.loader import gguf_weights
    from octavo.model_source import ModelSource

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path))
    cfg = read_arch_config(ModelSource(smollm_gguf.name, smollm_gguf))
    first = gguf_weights.gguf_tensor_types(smollm_gguf, cfg)
    assert first["model.layers.0.self_attn.q_proj.weight"] == Q.Q4_1
    monkeypatch.setattr("gguf.GGUFReader", lambda *a: pytest.fail("parsed again"))
    assert gguf_weights.gguf_tensor_types(smollm_gguf, cfg) == first


def test_ggml_types_match_the_gguf_package():
    """octavo's own GGML type numbers (imported without the gguf package) are the format's."""
    from octavo.model.quant.ggml_types import GGMLType

    for t in GGMLType:
        assert Q[t.name] == t
        assert hash(Q[t.name]) == hash(t)
