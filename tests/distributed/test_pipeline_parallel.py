"""Pipeline parallelism on local processes against transformers: each stage runs its range of
the layers and hands its hidden states on; the last samples. Tokens and prompt logprobs as in
test_tensor_parallel (a stage boundary changes no arithmetic: float32 results match to 1e-4)."""
from __future__ import annotations

import pytest

from octavo import LLM
from octavo.distributed import parallel_state
from octavo.distributed.parallel_state import RankPlacement
from octavo.model.pipeline import local_layer_name, stage_range
from tests.distributed.test_tensor_parallel import _check, _prompt, _reference, _run
from tests.parity.test_tiny_models import _build


@pytest.mark.parametrize("name,tp,pp", [("llama-default", 1, 2), ("gemma3", 1, 3),
                                        ("qwen3-moe", 1, 2), ("gpt2", 1, 2),
                                        ("llama-default", 2, 2)])
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
