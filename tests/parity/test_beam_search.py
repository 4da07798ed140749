"""Beam search against transformers' `generate(num_beams=..., do_sample=False)` on a tiny random
Llama in float32: the same beams, in the same order, with the same scores; and beams leave no
block behind."""
from __future__ import annotations

import json

import pytest
import torch

from octavo import BeamSearchParams, LLM
from tests.parity.test_tiny_models import _build

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm_oracle_folder):
    """The tiny Llama, with an EOS id chosen among tokens beams actually reach (a random model
    almost never picks the tokenizer's own), so beams finish early and the EOS paths run."""
    folder, ref = _build(tmp_path_factory.mktemp("beam"), smollm_oracle_folder, "llama-default")
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (21, 34, 9)]
    with torch.inference_mode():
        free = ref.generate(torch.tensor([prompts[0]]), num_beams=3, do_sample=False,
                            max_new_tokens=4, eos_token_id=None, pad_token_id=0)
    eos = int(free[0, len(prompts[0]) + 2])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=128)
    return llm, ref, prompts


def _reference(ref, prompt, eos_ids, width, penalty, early, ignore_eos):
    eos = sorted(eos_ids)
    with torch.inference_mode():
        out = ref.generate(torch.tensor([prompt]), num_beams=width, do_sample=False,
                           num_return_sequences=width, max_new_tokens=MAX_TOKENS,
                           length_penalty=penalty, early_stopping=early,
                           eos_token_id=None if ignore_eos else eos,
                           pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
    beams = []
    for seq, score in zip(out.sequences[:, len(prompt):].tolist(), out.sequences_scores.tolist()):
        if not ignore_eos:
            cut = next((i for i, t in enumerate(seq) if t in eos_ids), None)
            seq = seq if cut is None else seq[:cut + 1]
        beams.append((seq, score))
    return beams


@pytest.mark.parametrize("width,penalty,early,ignore_eos", [
    (2, 1.0, False, False),
    (3, 0.5, True, False),
    (4, 2.0, "never", False),
    (3, -1.0, False, True),
])
def test_beam_search_matches_transformers(tiny, width, penalty, early, ignore_eos):
    llm, ref, prompts = tiny
    eos_ids = llm.engine.setup.eos_token_ids
    params = BeamSearchParams(beam_width=width, max_tokens=MAX_TOKENS, length_penalty=penalty,
                              early_stopping=early, ignore_eos=ignore_eos)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs):
        expected = _reference(ref, prompt, eos_ids, width, penalty, early, ignore_eos)
        n_prompt = len(prompt)  # token ids: vLLM's sequences start with the prompt
        got = [(seq.tokens[n_prompt:], seq.cum_logprob / (len(seq.tokens) - n_prompt) ** penalty)
               for seq in out.sequences]
        assert all(seq.tokens[:n_prompt] == list(prompt) for seq in out.sequences)
        assert [g[0] for g in got] == [e[0] for e in expected]
        for (_, ours), (_, theirs) in zip(got, expected):
            assert ours == pytest.approx(theirs, abs=1e-3)
        for seq in out.sequences:
            assert seq.finish_reason == ("stop" if seq.tokens[-1] in eos_ids and not ignore_eos
                                         else "length")
            assert len(seq.logprobs) == len(seq.tokens) - n_prompt
            # each step's candidates hold the token the beam took, with its rank
            assert all(tok in step for tok, step in zip(seq.tokens[n_prompt:], seq.logprobs))
            assert seq.cum_logprob == pytest.approx(sum(
                step[tok].logprob for tok, step in zip(seq.tokens[n_prompt:], seq.logprobs)),
                abs=1e-4)
    # Beams share their prompt's blocks through the prefix cache, and give every block back.
    core = llm.engine.client.core
    kv = core.scheduler.kv
    assert kv.prefix_hits > 0
    assert not kv.block_tables and all(c == 0 for c in kv.pool.ref_counts)
    assert not llm.engine.has_unfinished_requests()


def test_some_beams_end_with_eos(tiny):
    """The EOS chosen for the fixture does end beams (else the EOS paths above ran for nothing)."""
    llm, _, prompts = tiny
    outs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=MAX_TOKENS))
    assert any(seq.finish_reason == "stop" for o in outs for seq in o.sequences)


def test_beam_search_params_are_checked():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(beam_width=2, max_tokens=4, temperature=0.7)
    with pytest.raises(ValueError, match="early_stopping"):
        BeamSearchParams(beam_width=2, max_tokens=4, early_stopping="sometimes")


def test_best_of_returns_the_n_most_likely_samples(tiny):
    """best_of=4, n=2 samples the same four sequences as n=4 with the same seed (sample i is
    seeded seed + i) and returns the two of highest cumulative logprob, best first."""
    from octavo import SamplingParams

    llm, _, prompts = tiny
    common = dict(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    every = llm.generate(prompts[0], SamplingParams(n=4, logprobs=0, **common),
                         use_tqdm=False)[0].outputs
    ranked = sorted(every, key=lambda c: -c.cumulative_logprob)
    assert ranked[0].token_ids != ranked[1].token_ids
    best = llm.generate(prompts[0], SamplingParams(n=2, best_of=4, **common),
                        use_tqdm=False)[0].outputs
    assert [c.index for c in best] == [0, 1]
    assert [c.token_ids for c in best] == [c.token_ids for c in ranked[:2]]
    assert [c.cumulative_logprob for c in best] == pytest.approx(
        [c.cumulative_logprob for c in ranked[:2]], abs=1e-5)
    assert best[0].logprobs is None  # ranked by logprob, but not asked to return them
    with pytest.raises(ValueError, match="best_of must be >= n"):
        SamplingParams(n=3, best_of=2)
