"""Pipeline parallelism on local processes against transformers: each stage runs its range of
the layers and hands its hidden states on; the last samples. Tokens and prompt logprobs as in
test_tensor_parallel (a stage boundary changes no arithmetic: float32 results match to 1e-4)."""
from __future__ import annotations

import pytest

from octavo import LLM
from octavo.distributed import parallel_state
from octavo.distributed.parallel_state import RankPlacement
from octavo.model.pipeline import local_layer_name, stage_range
from tests.distributed.test_tensor_parallel import (_check, _prompt, _reference, _run,
                                                     compare_smollm2)
from tests.parity.test_tiny_models import _build


@pytest.mark.parametrize("name,tp,pp", [("llama-default", 1, 2), ("gemma3", 1, 3),
                                        ("qwen3-moe", 1, 2), ("qwen3-qk-norm", 1, 2),
                                        ("gpt2", 1, 2), ("llama-default", 2, 2),
                                        ("qwen3-next", 1, 2)])
def test_stages_match_transformers(tmp_path, smollm_oracle_folder, name, tp, pp):
    """Chunked prefill and the prefix cache, as with tensor parallelism; Gemma 3's three layers
    on three stages (its sliding and global layers on different stages)."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, name)
    prompt = _prompt()
    expected = _reference(ref, prompt)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        for out in _run(llm, [prompt, _prompt(2)]) + _run(llm, [prompt]):
            if out.prompt_token_ids == prompt:
                _check(out, prompt, *expected, atol=1e-4 if tp == 1 else 1e-2)
    finally:
        llm.engine.shutdown()


def test_layers_split_evenly_and_names_follow(monkeypatch):
    monkeypatch.setattr(parallel_state, "_placement", RankPlacement(1, pp_size=3))
    assert stage_range(10) == range(4, 7)  # 4 + 3 + 3
    assert local_layer_name("model.layers.5.mlp.down_proj.weight", 10) == \
        "model.layers.1.mlp.down_proj.weight"
    assert local_layer_name("model.layers.7.mlp.down_proj.weight", 10) is None
    assert local_layer_name("model.norm.weight", 10) == "model.norm.weight"
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds"):
        stage_range(2)


def test_int4_stages_with_preemption_match_one_process(tmp_path, smollm_oracle_folder):
    """--quantization int4 on two stages, four prompts in a KV cache of 24 blocks (each stage
    holds one layer's): preempted and recomputed, as the single process computes them."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    prompts = [_prompt(seed) for seed in range(4)]
    kwargs = dict(dtype="float32", max_model_len=256, quantization="int4",
                  max_num_batched_tokens=64)
    single = LLM(str(folder), kv_cache_memory=16 << 20, **kwargs)
    expected = _run(single, prompts)
    single.engine.shutdown()
    block_bytes = 2 * 16 * 2 * 16 * 4  # K and V, 16 tokens, 2 KV heads of 16, fp32, one layer
    llm = LLM(str(folder), kv_cache_memory=24 * block_bytes, pipeline_parallel_size=2, **kwargs)
    try:
        for out, exp in zip(_run(llm, prompts), expected):
            assert out.outputs[0].token_ids == exp.outputs[0].token_ids
        assert llm.engine.client.core.scheduler.num_preemptions > 0
    finally:
        llm.engine.shutdown()


def test_smollm2_gguf_on_two_stages(smollm_gguf):
    """The real model's 30 layers, 15 a stage, its int4 decode copies and fused decode stack on
    each; float32, so a stage boundary changes nothing."""
    compare_smollm2(pipeline_parallel_size=2)
