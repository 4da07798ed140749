"""Greedy tokens and logprobs of octavo against transformers on SmolLM2-135M-Instruct (GGUF).

The criterion is in greedy.py. Run one at a time, all in one batch, and with a small token budget
and KV cache so that chunked prefill and preemption happen.
"""
from __future__ import annotations

import pytest

from octavo import LLM, SamplingParams
from tests.parity.greedy import PARAMS, check, check_prompt_logprobs, check_single_and_batched
from tests.parity.greedy import oracle_results


@pytest.fixture(scope="module")
def oracle(smollm_oracle_folder):
    return oracle_results(smollm_oracle_folder)


def test_one_at_a_time_and_batched(smollm_llm, oracle):
    check_single_and_batched(smollm_llm, *oracle)


def test_chunked_prefill_and_preemption(smollm_gguf, oracle):
    prompts, results = oracle
    # 42 blocks of 16 tokens: the longest prompt alone needs 40 of them.
    block_bytes = 2 * 16 * 3 * 64 * 4 * 30
    llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=640, max_num_batched_tokens=64,
              kv_cache_memory=42 * block_bytes)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.engine.client.core.scheduler.num_preemptions > 0
    assert check(outs, results) >= 6


def test_prompt_logprobs_match(smollm_llm, oracle):
    check_prompt_logprobs(smollm_llm, *oracle)


def test_hf_folder_loads_like_gguf(smollm_oracle_folder, smollm_llm, oracle):
    """The safetensors path (oracle folder) gives the same greedy tokens as the GGUF path."""
    prompts, _ = oracle
    folder_llm = LLM(str(smollm_oracle_folder), dtype="float32", max_model_len=2048,
                     kv_cache_memory=128 << 20)
    params = SamplingParams(max_tokens=16, temperature=0)
    a = folder_llm.generate(prompts[:4], params, use_tqdm=False)
    b = smollm_llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
