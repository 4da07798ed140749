"""Validation of SamplingParams: every invalid field raises a ValueError that names the field."""
from __future__ import annotations

import math

import pytest

from octavo.params import SamplingParams

INVALID = [
    ("n", dict(n=0)),
    ("n", dict(n=1.5)),
    ("n", dict(n=True)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature="hot")),
    ("temperature", dict(temperature=math.nan)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.5)),
    ("top_p", dict(top_p=-0.1)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=2**63)),
    ("seed", dict(seed=2**64)),
    ("seed", dict(seed=-2**63 - 1)),
    ("n", dict(n=2**70)),
    ("temperature", dict(temperature=math.inf)),
    ("top_p", dict(top_p=10**400)),
    ("repetition_penalty", dict(repetition_penalty=math.inf)),
    ("top_k", dict(top_k=2.0)),
    ("min_p", dict(min_p=1.5)),
    ("min_p", dict(min_p=-0.1)),
    ("seed", dict(seed="42")),
    ("presence_penalty", dict(presence_penalty=3)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("frequency_penalty", dict(frequency_penalty=2.01)),
    ("repetition_penalty", dict(repetition_penalty=0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-5)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=17, max_tokens=16)),
    ("logit_bias", dict(logit_bias={5: 200})),
    ("logit_bias", dict(logit_bias={5: -100.5})),
    ("logit_bias", dict(logit_bias={"abc": 1.0})),
    ("logit_bias", dict(logit_bias={-1: 1.0})),
    ("logit_bias", dict(logit_bias={5: "big"})),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", 3])),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[1, "2"])),
    ("logprobs", dict(logprobs=-2)),
    ("prompt_logprobs", dict(prompt_logprobs=-2)),
    ("ignore_eos", dict(ignore_eos="yes")),
    ("include_stop_str_in_output", dict(include_stop_str_in_output=1)),
    ("skip_special_tokens", dict(skip_special_tokens=None)),
]


@pytest.mark.parametrize("field,kwargs", INVALID,
                         ids=[f"{f}-{list(k.values())[0]!r}" for f, k in INVALID])
def test_invalid_field_raises_value_error_naming_it(field, kwargs):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert field in str(info.value)


def test_defaults_construct():
    p = SamplingParams()
    assert p.n == 1 and p.temperature == 1.0 and p.top_p == 1.0 and p.top_k == 0
    assert p.min_p == 0.0 and p.seed is None and p.max_tokens == 16 and p.min_tokens == 0
    assert p.stop_strings == [] and p.stop_token_ids == []
    assert p.logit_bias is None and p.logprobs is None and p.prompt_logprobs is None
    assert not p.greedy and not p.has_penalties()


def test_top_k_minus_one_is_off():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_normalization():
    p = SamplingParams(stop="x")
    assert p.stop_strings == ["x"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop=None).stop_strings == []
    assert SamplingParams(stop_token_ids=[3, 0]).stop_token_ids == [3, 0]


def test_valid_edges_construct():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=0, min_p=1.0)
    SamplingParams(top_p=1e-9, min_p=0.0)
    SamplingParams(presence_penalty=2, frequency_penalty=-2, repetition_penalty=1e-3)
    SamplingParams(max_tokens=None, min_tokens=1000)
    SamplingParams(max_tokens=4, min_tokens=4)
    SamplingParams(logprobs=0, prompt_logprobs=0, seed=-5, n=3)
    SamplingParams(ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False)


def test_logit_bias_normalized_to_int_keys_and_float_values():
    p = SamplingParams(logit_bias={"5": 1, 7: -100, 9: 100.0})
    assert p.logit_bias == {5: 1.0, 7: -100.0, 9: 100.0}
    assert all(type(k) is int and type(v) is float for k, v in p.logit_bias.items())


def test_greedy_and_penalty_flags():
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert SamplingParams(presence_penalty=0.1).has_penalties()
    assert SamplingParams(frequency_penalty=-0.1).has_penalties()
    assert SamplingParams(repetition_penalty=1.1).has_penalties()


def test_limits_and_model_bounds_offline(smollm_llm):
    """What the processor checks against the model and RequestLimits, offline as on the server:
    the vocabulary bounds top_k and logprobs; a beam width past half the vocabulary is refused;
    n-fanned seeds wrap within int64."""
    from octavo.engine.processor import RequestLimits
    from octavo.params import BeamSearchParams

    processor = smollm_llm.engine.processor
    vocab = processor.vocab_size
    with pytest.raises(ValueError, match="top_k must be <= the vocabulary size"):
        smollm_llm.generate("hi", SamplingParams(top_k=vocab + 1, max_tokens=1))
    with pytest.raises(ValueError, match="priority"):
        smollm_llm.generate(["hi"], SamplingParams(max_tokens=1), priority=[2**31])
    with pytest.raises(ValueError, match="half the vocabulary"):
        smollm_llm.beam_search(["hi"], BeamSearchParams(beam_width=vocab // 2 + 1, max_tokens=1))
    out = smollm_llm.generate("hi", SamplingParams(n=2, seed=2**63 - 1, max_tokens=2))
    assert len(out[0].outputs) == 2
    limited = RequestLimits(max_n=2, max_stop=1, max_stop_length=3)
    was, processor.limits = processor.limits, limited
    try:
        for params, field in ((SamplingParams(n=3, max_tokens=1), "n must be <= 2"),
                              (SamplingParams(stop=["a", "b"], max_tokens=1), "--max-stop"),
                              (SamplingParams(stop=["abcd"], max_tokens=1), "--max-stop-length")):
            with pytest.raises(ValueError, match=field):
                smollm_llm.generate("hi", params)
    finally:
        processor.limits = was
    with pytest.raises(ValueError, match="max_n"):
        RequestLimits(max_n=0)
