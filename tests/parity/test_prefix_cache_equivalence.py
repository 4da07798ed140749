"""Outputs are the same with prefix caching on and off, on the real model."""
from __future__ import annotations

import numpy as np
import pytest

from octavo import LLM, SamplingParams

BLOCK = 16


@pytest.fixture(scope="module")
def uncached(smollm_gguf):
    return LLM(str(smollm_gguf), dtype="float32", max_model_len=2048, max_num_seqs=16,
               kv_cache_memory=256 << 20, enable_prefix_caching=False)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(0)
    base = rng.integers(100, 40000, 200).tolist()
    return [
        base,                                                   # warms the cache
        rng.integers(100, 40000, 150).tolist(),                 # shares 0 blocks
        base[:BLOCK] + rng.integers(100, 40000, 40).tolist(),   # shares 1 block
        base[:10 * BLOCK] + rng.integers(100, 40000, 7).tolist(),  # shares many
        list(base),                                             # shares all
        base[:12 * BLOCK],                                      # block-aligned, all cached
    ]


def _same(a, b, atol=1e-3):
    for x, y in zip(a, b):
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.token_ids == cy.token_ids
            if cx.logprobs is not None:
                for px, py in zip(cx.logprobs, cy.logprobs):
                    assert px.keys() == py.keys() or list(px)[0] == list(py)[0]
                    tok = list(px)[0]
                    assert abs(px[tok].logprob - py[tok].logprob) < atol


def test_shared_prefixes_give_the_same_outputs(smollm_llm, uncached):
    prompts = _prompts()
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    smollm_llm.generate(prompts[:1], params, use_tqdm=False)  # cache the base prompt
    cached = [smollm_llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
    plain = [uncached.generate([p], params, use_tqdm=False)[0] for p in prompts]
    _same(cached, plain)
    hits = [o.num_cached_tokens for o in cached]
    assert hits[0] >= 192 and hits[1] == 0 and hits[2] == BLOCK and hits[3] == 10 * BLOCK
    assert hits[4] == 192  # all 12 full blocks; the tail is recomputed
    assert hits[5] == 11 * BLOCK  # the last token of an all-cached prompt is always computed
    assert all(o.num_cached_tokens == 0 for o in plain)


def test_parallel_sampling_shares_and_matches(smollm_llm, uncached):
    prompt = _prompts()[3]
    params = SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=11)
    a = smollm_llm.generate([prompt], params, use_tqdm=False)[0]
    b = uncached.generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]


def test_preemption_and_chunked_prefill_match(smollm_gguf):
    prompts = _prompts()
    block_bytes = 2 * 16 * 3 * 64 * 4 * 30
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=2)
    outs = []
    for caching in (True, False):
        llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=320, max_num_batched_tokens=48,
                  kv_cache_memory=24 * block_bytes, enable_prefix_caching=caching)
        outs.append(llm.generate(prompts, params, use_tqdm=False))
        assert llm.engine.client.stats().num_preemptions > 0
    _same(*outs)


def test_long_shared_prefix_computes_only_the_suffix(smollm_llm):
    rng = np.random.default_rng(5)
    prefix = rng.integers(100, 40000, 1000).tolist()
    params = SamplingParams(max_tokens=4, temperature=0)
    smollm_llm.generate([prefix + [500, 501, 502]], params, use_tqdm=False)
    second = smollm_llm.generate([prefix + [900, 901, 902, 903]], params, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 992


def test_reset_prefix_cache(smollm_llm):
    prompt = _prompts()[0]
    params = SamplingParams(max_tokens=2, temperature=0)
    smollm_llm.generate([prompt], params, use_tqdm=False)
    assert smollm_llm.reset_prefix_cache() is True
    again = smollm_llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    engine = smollm_llm.engine
    engine.add_request("busy", prompt, SamplingParams(max_tokens=50))
    engine.step()
    assert smollm_llm.reset_prefix_cache() is False  # refused while a request runs
    engine.abort_request("busy")
    engine.step()
    assert smollm_llm.reset_prefix_cache() is True
