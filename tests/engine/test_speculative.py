"""Speculative decoding (n-gram) end to end: the rejection sampler on synthetic logits keeps the
target distribution (point-mass n-gram drafts, and drafts with a draft model's q); greedy and
seeded outputs equal plain decoding token for token, batched, on SmolLM2 and on a tiny random
Llama; logprobs and penalties per emitted token; preemption with a tiny KV budget; the block pool
returns to idle."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.worker.sampler import Sampler, SamplingBatch
from octavo.worker.spec.rejection import accept_drafts

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
CODE = ("def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
        "def mul(a, b):\n    return a * b\n")
PROMPTS = ["Repeat this code exactly:\n" + CODE + "\nRepeated:\n",
           "List: apple, pear, plum, apple, pear, plum, apple,",
           "The capital of France is", "Write a short poem about the sea.",
           "1, 2, 3, 4, 5, 6, 7,"]


def _batch(n: int, temperature: float, top_k: int, seeds=None) -> SamplingBatch:
    f = lambda v, dt=torch.float32: torch.full((n,), v, dtype=dt)  # noqa: E731
    return SamplingBatch(False, f(temperature), f(top_k, torch.int64), f(1.0), f(0.0),
                         f(False, torch.bool), np.array(seeds or [-1] * n))


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.7, 3)])
def test_rejection_sampling_keeps_the_target_distribution(temperature, top_k):
    """Two verified positions per trial with draft d at position 0: the first emitted token must
    follow the target distribution p0 (after temperature / top-k), d is accepted with
    probability p0(d), and the token after an accepted d follows p1."""
    trials, vocab = 20000, 6
    gen = torch.Generator().manual_seed(0)
    logits0, logits1 = torch.randn(vocab, generator=gen), torch.randn(vocab, generator=gen)
    draft = int(logits0.argsort()[-2])  # the second most likely token
    logits = torch.stack([logits0, logits1]).repeat(trials, 1)  # [2 * trials, V]
    batch = _batch(2 * trials, temperature, top_k)
    probs = Sampler.probabilities(logits[:2].clone(), _batch(2, temperature, top_k))
    tokens, _ = Sampler(1)(logits.clone(), batch)
    emitted, _ = accept_drafts(tokens.numpy(), [[draft]] * trials)
    first = np.array([e[0] for e in emitted])
    freq0 = np.bincount(first, minlength=vocab) / trials
    assert 0.5 * np.abs(freq0 - probs[0].numpy()).sum() < 0.02  # total variation
    accepted = [e[1] for e in emitted if len(e) == 2]
    assert abs(len(accepted) / trials - float(probs[0, draft])) < 0.015
    freq1 = np.bincount(accepted, minlength=vocab) / len(accepted)
    assert 0.5 * np.abs(freq1 - probs[1].numpy()).sum() < 0.03
    assert all(len(e) == 1 and e[0] != draft for e in emitted if e[0] != draft)


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (0.8, 4)])
def test_rejection_with_a_draft_distribution_keeps_the_target_distribution(temperature, top_k):
    """A draft model's drafts: d ~ q at position 0 (q far from p), verified against q. The first
    emitted token follows p0, d is accepted with probability sum_x min(p0(x), q(x)), and the
    token after an accepted d follows p1."""
    trials, vocab = 20000, 6
    gen = torch.Generator().manual_seed(1)
    logits0, logits1 = torch.randn(vocab, generator=gen), torch.randn(vocab, generator=gen)
    q = torch.softmax(-logits0 * 1.5, dim=0)  # favours what the target finds unlikely
    drafts = torch.multinomial(q, trials, replacement=True, generator=gen)  # [trials]
    logits = torch.stack([logits0, logits1]).repeat(trials, 1)  # [2 * trials, V]
    batch = _batch(2 * trials, temperature, top_k)
    batch.draft_rows = torch.arange(0, 2 * trials, 2)
    batch.draft_tokens = drafts
    batch.draft_probs = q.expand(trials, vocab)
    p = Sampler.probabilities(logits[:2].clone(), _batch(2, temperature, top_k))
    tokens, _ = Sampler(2)(logits.clone(), batch)
    emitted, _ = accept_drafts(tokens.numpy(), [[d] for d in drafts.tolist()])
    freq0 = np.bincount([e[0] for e in emitted], minlength=vocab) / trials
    assert 0.5 * np.abs(freq0 - p[0].numpy()).sum() < 0.02  # total variation
    accepted = [e[1] for e in emitted if len(e) == 2]
    assert abs(len(accepted) / trials - float(torch.minimum(p[0], q).sum())) < 0.015
    freq1 = np.bincount(accepted, minlength=vocab) / len(accepted)
    assert 0.5 * np.abs(freq1 - p[1].numpy()).sum() < 0.03


def test_greedy_rejection_emits_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [5.0, 0.0, 0.0], [0.0, 0.0, 9.0]])
    batch = _batch(3, 0.0, 0)
    batch.greedy[:] = True
    batch.all_greedy = True
    tokens, _ = Sampler(0)(logits, batch)
    assert accept_drafts(tokens.numpy(), [[1, 2]]) == ([[1, 0]], pytest.approx([0, 1]))


@pytest.fixture(scope="module")
def spec_llm(smollm_gguf):
    return LLM(str(smollm_gguf), dtype="float32", max_model_len=2048, max_num_seqs=16,
               kv_cache_memory=256 << 20, speculative_config=SPEC)


def _tokens(llm, prompts, params):
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def test_greedy_and_seeded_outputs_equal_plain_decoding(smollm_llm, spec_llm):
    greedy = SamplingParams(max_tokens=24, temperature=0)
    assert _tokens(spec_llm, PROMPTS, greedy) == _tokens(smollm_llm, PROMPTS, greedy)
    stats = spec_llm.engine.client.stats()
    assert stats.spec_accepted_tokens > 8 and stats.spec_mean_acceptance_length > 1.5
    # Seeded sampling draws from (seed, output position): the same tokens, also with n > 1,
    # penalties and logprobs of every emitted token.
    seeded = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=7, n=2,
                            frequency_penalty=0.3, repetition_penalty=1.1, logprobs=2)
    a, b = spec_llm.generate(PROMPTS[:2], seeded), smollm_llm.generate(PROMPTS[:2], seeded)
    for oa, ob in zip(a, b):
        for ca, cb in zip(oa.outputs, ob.outputs):
            assert ca.token_ids == cb.token_ids
            assert len(ca.logprobs) == len(ca.token_ids)
            for la, lb, t in zip(ca.logprobs, cb.logprobs, ca.token_ids):
                assert la[t].logprob == pytest.approx(lb[t].logprob, abs=1e-3)
                assert la.keys() == lb.keys()
    # A constrained request batched with speculated ones (its drafts cut by its grammar): unchanged.
    mixed = [SamplingParams(max_tokens=8, temperature=0, structured_outputs=(
        StructuredOutputsParams(regex="(ab|cd)+") if i == 1 else None)) for i in range(3)]
    got = [o.outputs[0].token_ids for o in spec_llm.generate(PROMPTS[:3], mixed)]
    assert got == [o.outputs[0].token_ids for o in smollm_llm.generate(PROMPTS[:3], mixed)]
    assert spec_llm.engine.client.stats().kv_cache_usage == 0


def test_preemption_with_speculation(smollm_gguf, smollm_llm):
    tight = LLM(str(smollm_gguf), dtype="float32", max_model_len=128, max_num_seqs=8,
                kv_cache_memory=128 * 30 * 2 * 3 * 64 * 4, block_size=16,  # 8 blocks
                speculative_config=SPEC)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[0] + " "]
    params = SamplingParams(max_tokens=24, temperature=0)
    out = _tokens(tight, prompts, params)
    stats = tight.engine.client.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert stats.kv_cache_usage == 0
    assert out == _tokens(smollm_llm, prompts, params)


def test_tiny_random_llama_greedy_equality(tmp_path, smollm_oracle_folder):
    from tests.parity.test_tiny_models import _build

    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    gen = torch.Generator().manual_seed(5)
    prompts = []
    for n in (12, 30, 7):
        base = torch.randint(100, 49000, (n,), generator=gen).tolist()
        prompts.append(base * 3)  # repeated, so drafts are proposed
    prompts.append(torch.randint(100, 49000, (40,), generator=gen).tolist())
    kw = dict(dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    params = SamplingParams(max_tokens=16, temperature=0)
    plain = LLM(str(folder), **kw).generate(prompts, params)
    spec = LLM(str(folder), speculative_config=SPEC, **kw)
    fast = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.client.stats().spec_draft_tokens > 0
    assert spec.engine.client.stats().kv_cache_usage == 0
