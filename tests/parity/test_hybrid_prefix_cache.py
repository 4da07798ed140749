"""Prefix caching over linear-attention layers (Qwen3-Next): a cached prefix resumes from the
recurrent states saved at a boundary (core/state_checkpoints.py), and every output is still
transformers'."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from tests.parity.test_tiny_models import _build

INTERVAL = 32  # --mamba-block-size: two blocks of 16


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, smollm_oracle_folder):
    return _build(tmp_path_factory.mktemp("hybrid"), smollm_oracle_folder, "qwen3-next")


def _greedy(ref, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        return ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                            pad_token_id=0)[0, len(prompt):].tolist()


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["stack", "layers"])
def test_cached_prefixes_resume_from_saved_states(hybrid, enforce_eager):
    """Chunks of 40 tokens (boundaries fall inside them, so a chunk is computed in pieces),
    prompts sharing 0, 50, 70 and all of a 100-token prefix, and a prompt that continues an
    earlier request's prompt and output (its boundary saved by a decode step): each gives
    transformers' tokens, the hits end at saved boundaries, and the logprobs equal a run
    without caching. The stack path also takes prompts with saves beside decodes."""
    folder, ref = hybrid
    gen = torch.Generator().manual_seed(3)
    base = torch.randint(100, 49000, (100,), generator=gen).tolist()
    tail = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (20, 9, 13)]
    prompts = [base, tail[0] + base[:50], base[:50] + tail[1], base[:70] + tail[2], base]
    expected = [_greedy(ref, p, 6) for p in prompts]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=3)
    kwargs = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
                  max_num_batched_tokens=40, enforce_eager=enforce_eager)
    cached = LLM(str(folder), mamba_block_size=INTERVAL, **kwargs)
    try:
        outs = [cached.generate([p], params, use_tqdm=False)[0] for p in prompts]
        # 44 + 30 = 74 tokens: the boundary at 64 is saved by a decode step
        grown = outs[0].prompt_token_ids[:44]
        first = cached.generate([grown], SamplingParams(max_tokens=30, temperature=0,
                                                        ignore_eos=True), use_tqdm=False)[0]
        resumed = grown + list(first.outputs[0].token_ids) + tail[1]
        last = cached.generate([resumed], params, use_tqdm=False)[0]
        checkpoints = cached.engine.client.core.scheduler.kv.checkpoints
        assert checkpoints.restores >= 4 and len(checkpoints) >= 4
    finally:
        cached.engine.shutdown()
    assert [o.num_cached_tokens for o in outs] == [0, 0, 32, 64, 96]
    assert last.num_cached_tokens == 64
    for out, tokens in zip(outs, expected):
        assert list(out.outputs[0].token_ids) == tokens
    assert list(first.outputs[0].token_ids) == _greedy(ref, grown, 30)
    assert list(last.outputs[0].token_ids) == _greedy(ref, resumed, 6)

    plain = LLM(str(folder), enable_prefix_caching=False, **kwargs)
    try:
        again = [plain.generate([p], params, use_tqdm=False)[0] for p in prompts[2:]]
    finally:
        plain.engine.shutdown()
    for a, b in zip(outs[2:], again):
        for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            token = next(iter(pa))
            assert abs(pa[token].logprob - pb[token].logprob) < 1e-4


def test_few_slots_are_replaced_and_a_batch_shares_its_boundaries(hybrid):
    """Two checkpoint slots for a batch of six requests, two of them with the same prompt and
    the others sharing its first 64 tokens (later ones resume from the boundaries earlier ones
    save in the same batch), a KV cache that preempts: the slots are replaced
    least recently used first (never one twice in a step), and every request still gives
    transformers' tokens; reset_prefix_cache forgets the saved states too."""
    folder, ref = hybrid
    gen = torch.Generator().manual_seed(4)
    base = torch.randint(100, 49000, (90,), generator=gen).tolist()
    prompts = [base, base] + [base[:64] + torch.randint(100, 49000, (n,), generator=gen).tolist()
                              for n in (5, 17, 30, 41)]
    expected = [_greedy(ref, p, 8) for p in prompts]
    per_block = 2 * 16 * 2 * 32 * 4  # the attention layer's K and V of 16 tokens
    states = (4 + 2) * (128 * 3 * 4 + 4 * 16 * 16 * 4)  # (rows + slots) x one request's
    llm = LLM(str(folder), dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=48, mamba_block_size=INTERVAL, state_checkpoints=2,
              kv_cache_memory=states + 10 * per_block)
    try:
        core = llm.engine.client.core
        assert core.num_blocks == 10  # the slots' memory comes out of the KV cache's
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        kv = core.scheduler.kv
        assert kv.checkpoints.saves > 2 and len(kv.checkpoints) == 2
        assert core.scheduler.num_preemptions > 0 and kv.checkpoints.restores > 2
        assert max(o.num_cached_tokens for o in outs) == 64
        assert llm.reset_prefix_cache() and len(kv.checkpoints) == 0
    finally:
        llm.engine.shutdown()
    for out, tokens in zip(outs, expected):
        assert list(out.outputs[0].token_ids) == tokens
