"""Context parallelism on local processes against the single-process engine, float32: a 4,000-token
prompt (chunked over 512-token steps, beside a shorter one) with each context-parallel mode of two
ranks, prompt logprobs within 1e-3 and the same greedy continuation, again from the prefix
cache; sliding windows, softcaps, a mixture of experts and linear attention; context
parallelism beside tensor and pipeline parallelism; and the decode mode holding a request twice
as long as one rank's cache."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.parity import test_tiny_models as tiny

LONG, NEW = 4000, 8
MODES = {"prefill": {"prefill_context_parallel_size": 2},
         "decode": {"decode_context_parallel_size": 2},
         "both": {"prefill_context_parallel_size": 2, "decode_context_parallel_size": 2}}
KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # layers x (K, V) x KV heads x head dim x fp32


def _model(tmp_path, oracle_folder, name: str, monkeypatch):
    config_cls, model_cls, extra = tiny.CASES[name]
    monkeypatch.setitem(tiny.CASES, name, (config_cls, model_cls,
                                           {**extra, "max_position_embeddings": LONG + 256}))
    return tiny._build(tmp_path, oracle_folder, name)[0]


def _prompts(*lengths: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in lengths]


def _run(folder, prompts, **kwargs):
    llm = LLM(str(folder), dtype="float32", max_model_len=LONG + 64,
              max_num_batched_tokens=512, **{"kv_cache_memory": 16 << 20, **kwargs})
    try:
        params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=5,
                                prompt_logprobs=0)
        outs = llm.generate(prompts, params, use_tqdm=False)
        # again, the prompts' leading blocks now in the prefix cache
        again = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0,
                                                     ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]
        block = llm.engine.config.core_block_size
        assert all(o.num_cached_tokens > 0 for o, p in zip(again, prompts) if len(p) > block)
        capacity = llm.engine.client.core.num_blocks * block
    finally:
        llm.engine.shutdown()
    return [(o.outputs[0].token_ids,
             torch.tensor([o.prompt_logprobs[i][p[i]].logprob for i in range(1, len(p))]))
            for o, p in zip(outs, prompts)], capacity


def _same(got, expected, atol=1e-3):
    for (tokens, scored), (ref_tokens, ref_scored) in zip(got, expected):
        assert tokens == ref_tokens
        assert torch.allclose(scored, ref_scored, atol=atol), (scored - ref_scored).abs().max()


def test_long_prompt_in_every_mode_matches_one_process(tmp_path, smollm_oracle_folder,
                                                       monkeypatch):
    """Decode context parallelism with a cache that one process cannot fit the request in: each
    rank keeps half of its blocks."""
    folder = _model(tmp_path, smollm_oracle_folder, "llama-default", monkeypatch)
    prompts = _prompts(LONG, 300)
    expected, _ = _run(folder, prompts)
    small = (LONG // 2 + 600) * KV_BYTES_PER_TOKEN  # one rank's share of the long request, and more
    with pytest.raises(ValueError, match="fewer than the"):
        _run(folder, prompts, kv_cache_memory=small)
    for mode, kwargs in MODES.items():
        memory = {"kv_cache_memory": small} if "decode_context_parallel_size" in kwargs else {}
        got, capacity = _run(folder, prompts, **kwargs, **memory)
        _same(got, expected)
        if memory:
            assert capacity >= LONG + 64 > capacity // 2, mode


@pytest.mark.parametrize("name", ["gemma3", "gemma2", "qwen3-moe", "qwen3-next"])
def test_families_match_one_process(tmp_path, smollm_oracle_folder, monkeypatch, name):
    """Interleaved sliding windows (Gemma 3), attention softcaps (Gemma 2), a mixture of experts,
    linear attention over a state (Qwen3-Next: every rank computes its layers over all of a
    step's tokens; states saved every 32 tokens for the prefix cache); five requests, so that
    steps mix decodes with prompt chunks."""
    folder = _model(tmp_path, smollm_oracle_folder, name, monkeypatch)
    prompts = _prompts(700, 90, 33, 250, 5)
    expected, _ = _run(folder, prompts, mamba_block_size=32)
    _same(_run(folder, prompts, mamba_block_size=32, **MODES["both"])[0], expected)


@pytest.mark.parametrize("kwargs", [
    {"tensor_parallel_size": 2, "decode_context_parallel_size": 2},
    {"pipeline_parallel_size": 2, "prefill_context_parallel_size": 2}],
    ids=["tp2-dcp2", "pp2-pcp2"])
def test_beside_tensor_and_pipeline_parallelism(tmp_path, smollm_oracle_folder, monkeypatch,
                                                kwargs):
    folder = _model(tmp_path, smollm_oracle_folder, "qwen3-moe", monkeypatch)
    prompts = _prompts(300, 40)
    expected, _ = _run(folder, prompts)
    _same(_run(folder, prompts, **kwargs)[0], expected)
