"""LLM(..., data_parallel_size=2): two engine core processes, a core each, behind the offline
front end: a mixed batch spread over both gives the single-core engine's greedy outputs, and
the stats add both replicas up."""
from __future__ import annotations

from octavo import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "import numpy as np\n", "Water boils at"]


def test_two_replicas_give_one_cores_outputs(smollm_llm, smollm_gguf):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    expected = smollm_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=512,
              kv_cache_memory=64 << 20, data_parallel_size=2)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        for out, exp in zip(outs, expected):
            assert out.outputs[0].token_ids == exp.outputs[0].token_ids
        loads = [r.stats.prefix_cache_queries for r in llm.engine.client.replicas]
        assert all(load > 0 for load in loads), loads  # both replicas computed prompts
        stats = llm.engine.client.stats()
        assert stats.prefix_cache_queries == sum(loads)
        assert llm.reset_prefix_cache()
    finally:
        llm.engine.shutdown()
    assert not any(r.process.is_alive() for r in llm.engine.client.replicas)

