"""Tensor parallelism on local processes against the oracle: tiny random models of each family
(transformers on the same weights) and the real SmolLM2 GGUF (the single-process engine), two
ranks each. Greedy tokens must agree, or at the first divergence each side's token be in the
other's top 5 (two ranks sum their partial products in another order); prompt logprobs within
1e-2 in float32."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.parity.test_tiny_models import _build

PROMPT_LEN, NEW = 150, 8


def _prompt(seed: int = 1) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (PROMPT_LEN,), generator=gen).tolist()


def _agree(ours: list[int], ours_top: list[dict], ref: list[int], ref_top: list[list[int]]):
    """Identical, or at the first divergence each side's token in the other's top 5."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert b in ours_top[i] and a in ref_top[i], (i, ours, ref)
            return
    assert len(ours) == len(ref)


def _reference(model, prompt: list[int]):
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    top = [s[0].topk(5).indices.tolist() for s in out.scores]
    scored = logprobs[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    return tokens, top, scored


def _run(llm: LLM, prompts: list[list[int]]):
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=5,
                            prompt_logprobs=0)
    return llm.generate(prompts, params, use_tqdm=False)


def _check(out, prompt, ref_tokens, ref_top, ref_scored, atol=1e-2):
    got = out.outputs[0]
    _agree(got.token_ids, [set(d) for d in got.logprobs], ref_tokens, ref_top)
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    assert torch.allclose(ours, ref_scored, atol=atol), (ours - ref_scored).abs().max()


@pytest.mark.parametrize("name", ["llama-default", "qwen3-qk-norm", "gemma3", "qwen3-moe",
                                  "qwen2-moe", "gpt2", "gpt-neox-parallel", "glm4", "gpt-oss",
                                  "deepseek-v3", "qwen3-next"])
def test_two_ranks_match_transformers(tmp_path, smollm_oracle_folder, name):
    """Chunked prefill (a 150-token prompt over 64-token steps) and the prefix cache (the same
    prompt again, its blocks cached; Qwen3-Next's from the states each rank saved after 128
    tokens) on two ranks."""
    folder, ref = _build(tmp_path, smollm_oracle_folder, name)
    prompt = _prompt()
    expected = _reference(ref, prompt)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, tensor_parallel_size=2, mamba_block_size=64)
    try:
        _check(_run(llm, [prompt])[0], prompt, *expected)
        again = llm.generate([prompt], SamplingParams(max_tokens=NEW, temperature=0,
                                                      ignore_eos=True, logprobs=5),
                             use_tqdm=False)[0]  # without prompt logprobs, which need no hits
        assert again.num_cached_tokens == (128 if name == "qwen3-next" else 144)
        _agree(again.outputs[0].token_ids, [set(d) for d in again.outputs[0].logprobs],
               *expected[:2])
    finally:
        llm.engine.shutdown()


def test_kv_heads_fewer_than_ranks_are_replicated(tmp_path, smollm_oracle_folder, monkeypatch):
    """One KV head over two ranks: each keeps it and half of the query heads."""
    from tests.parity import test_tiny_models as tiny

    monkeypatch.setitem(tiny.CASES, "llama-mqa", ("LlamaConfig", "LlamaForCausalLM",
                                                  {"num_key_value_heads": 1}))
    folder, ref = _build(tmp_path, smollm_oracle_folder, "llama-mqa")
    prompt = _prompt(3)
    expected = _reference(ref, prompt)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              tensor_parallel_size=2)
    try:
        _check(_run(llm, [prompt])[0], prompt, *expected)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_quantized_weights_on_two_ranks(tmp_path, smollm_oracle_folder, quantization):
    """--quantization at load on each rank's share; preemption too (a KV cache of 24 blocks for
    four 150-token prompts). Against the single-process engine with the same quantization: int4
    groups of 32 inputs are the same on a rank's half; int8 scales per output channel come from
    half of its inputs, so they differ slightly."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    prompts = [_prompt(seed) for seed in range(4)]
    kwargs = dict(dtype="float32", max_model_len=256, quantization=quantization,
                  max_num_batched_tokens=64)
    single = LLM(str(folder), kv_cache_memory=16 << 20, **kwargs)
    expected = _run(single, prompts)
    single.engine.shutdown()
    block_bytes = 2 * 16 * 16 * 4 * 2  # K and V, 16 tokens, a rank's KV head of 16, fp32, 2 layers
    llm = LLM(str(folder), kv_cache_memory=24 * block_bytes, tensor_parallel_size=2, **kwargs)
    try:
        outs = _run(llm, prompts)
        for out, exp, prompt in zip(outs, expected, prompts):
            ref = exp.outputs[0]
            scored = torch.tensor([exp.prompt_logprobs[p][prompt[p]].logprob
                                   for p in range(1, len(prompt))])
            _check(out, prompt, ref.token_ids, [list(d) for d in ref.logprobs], scored,
                   atol=1e-2 if quantization == "int4" else 5e-2)
        stats = llm.engine.client.core.scheduler.num_preemptions
        assert stats > 0
    finally:
        llm.engine.shutdown()


def compare_smollm2(**parallel) -> None:
    """The real SmolLM2 GGUF in float32 split as `parallel` says, against one process."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=5)
    kwargs = dict(dtype="float32", max_model_len=512, kv_cache_memory=1 << 27)
    single = LLM("smollm2-135m-instruct", **kwargs)
    expected = single.generate(prompts, params, use_tqdm=False)
    single.engine.shutdown()
    llm = LLM("smollm2-135m-instruct", **parallel, **kwargs)
    try:
        for out, exp in zip(llm.generate(prompts, params, use_tqdm=False), expected):
            a, b = out.outputs[0], exp.outputs[0]
            _agree(a.token_ids, [set(d) for d in a.logprobs], b.token_ids,
                   [list(d) for d in b.logprobs])
    finally:
        llm.engine.shutdown()


def test_smollm2_gguf_on_two_ranks(smollm_gguf):
    """The real model: 9 query heads over 3 KV heads, split 3 + 6 between the ranks; its GGUF's
    int4 copies for decode cut with the dense weights."""
    compare_smollm2(tensor_parallel_size=2)
