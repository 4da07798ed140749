"""Greedy tokens and logprobs of octavo against transformers on SmolLM2-135M-Instruct (GGUF).

Criterion: identical tokens, or at the first divergence each side's token is in the other's top-5
logprobs (then comparing stops). Run one at a time, all in one batch, and with a small token
budget and KV cache so that chunked prefill and preemption happen.
"""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams

NEW_TOKENS = 32
TOP = 5

_STORY = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each of the "
          "one hundred and twelve steps, listening to the sea breathe against the rocks below. ")


def _prompts(tokenizer) -> list[list[int]]:
    texts = [
        "The capital of France is",
        "def fib(n):",
        "Explain in a few sentences why the sky is blue.",
        "List three colors: red,",
        "import numpy as np\nimport torch\n\nclass Model(torch.nn.Module):\n    def __init__(self",
        _STORY * 4 + "What did the keeper count?",
        _STORY * 9 + "Summarize the story above in one sentence:",
        _STORY * 18 + "The keeper's name was",
    ]
    ids = [tokenizer(t).input_ids for t in texts]
    lengths = [len(i) for i in ids]
    assert min(lengths) >= 5 and 500 <= max(lengths) <= 600, lengths
    return ids


@pytest.fixture(scope="module")
def oracle(smollm_oracle_folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm_oracle_folder)
    model = AutoModelForCausalLM.from_pretrained(smollm_oracle_folder, dtype=torch.float32).eval()
    prompts = _prompts(tok)
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=tok.eos_token_id)
            tokens = out.sequences[0, len(ids):].tolist()
            top = [torch.log_softmax(l[0].float(), -1).topk(TOP).indices.tolist()
                   for l in out.logits]
            prompt_lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
            results.append((tokens, top, prompt_lp))
    return prompts, results


def _check(octavo_outs, oracle_results) -> int:
    """Assert the criterion for every prompt; returns how many matched exactly."""
    exact = 0
    for i, (out, (ref_tokens, ref_top, _)) in enumerate(zip(octavo_outs, oracle_results)):
        ours = out.outputs[0].token_ids
        ours_top = [list(pos) for pos in out.outputs[0].logprobs]
        n = min(len(ours), len(ref_tokens))
        for j in range(n):
            if ours[j] != ref_tokens[j]:
                assert ours[j] in ref_top[j] and ref_tokens[j] in ours_top[j], (
                    f"prompt {i} diverges at token {j}: octavo {ours[j]} (top {ours_top[j]}), "
                    f"transformers {ref_tokens[j]} (top {ref_top[j]})")
                break
        else:
            assert len(ours) == len(ref_tokens), f"prompt {i}: lengths {len(ours)} != {len(ref_tokens)}"
            exact += 1
    return exact


PARAMS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, logprobs=TOP)


def test_one_at_a_time_and_batched(smollm_llm, oracle):
    prompts, results = oracle
    single = [smollm_llm.generate([p], PARAMS, use_tqdm=False)[0] for p in prompts]
    assert _check(single, results) >= 6
    batched = smollm_llm.generate(prompts, PARAMS, use_tqdm=False)
    assert _check(batched, results) >= 6
    # Batch composition must not change greedy output beyond the top-5 tolerance either.
    assert sum(a.outputs[0].token_ids == b.outputs[0].token_ids
               for a, b in zip(single, batched)) >= 6


def test_chunked_prefill_and_preemption(smollm_gguf, oracle):
    prompts, results = oracle
    # 42 blocks of 16 tokens: the longest prompt alone needs 40 of them.
    block_bytes = 2 * 16 * 3 * 64 * 4 * 30
    llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=640, max_num_batched_tokens=64,
              kv_cache_memory=42 * block_bytes)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert llm.engine.client.core.scheduler.num_preemptions > 0
    assert _check(outs, results) >= 6


def test_prompt_logprobs_match(smollm_llm, oracle):
    prompts, results = oracle
    for ids, (_, _, ref_lp) in list(zip(prompts, results))[5:7]:
        out = smollm_llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2),
                                  use_tqdm=False)[0]
        assert out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(ids)
        ours = torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])
        ref = ref_lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        assert torch.allclose(ours, ref, atol=1e-2), (ours - ref).abs().max()


def test_hf_folder_loads_like_gguf(smollm_oracle_folder, smollm_llm, oracle):
    """The safetensors path (oracle folder) gives the same greedy tokens as the GGUF path."""
    prompts, _ = oracle
    folder_llm = LLM(str(smollm_oracle_folder), dtype="float32", max_model_len=2048,
                     kv_cache_memory=128 << 20)
    params = SamplingParams(max_tokens=16, temperature=0)
    a = folder_llm.generate(prompts[:4], params, use_tqdm=False)
    b = smollm_llm.generate(prompts[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
