"""The front end <-> core protocol (octavo/core/protocol.py) through its msgspec codec
(octavo/engine/messages.py): every field of every message survives the trip, typed."""
from __future__ import annotations

from dataclasses import MISSING, fields

import msgspec
import numpy as np
import pytest

from octavo.core.protocol import (
    AbortRequests, CoreOutputs, EngineCoreOutput, EngineCoreRequest, SchedulerStats, Shutdown,
    TopLogprobs, UtilityCall)
from octavo.engine import core_process
from octavo.engine.messages import encoder, input_decoder, output_decoder
from octavo.params import (
    ReasoningEndRule, RequestOutputKind, SamplingParams, StructuredOutputsParams)

# Between them, the two set every SamplingParams field away from its default (some exclude
# each other: min_tokens with a grammar, stop strings without detokenizing).
CONSTRAINED = SamplingParams(
    n=2, best_of=3, temperature=0.5, top_p=0.9, top_k=5, min_p=0.1, seed=-(2**63),
    presence_penalty=0.5, frequency_penalty=-0.5, repetition_penalty=1.2,
    logit_bias={7: -3.5, 2**31: 100.0}, max_tokens=None, stop=["END", "x"], stop_token_ids=[9],
    ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False, logprobs=3,
    prompt_logprobs=-1,
    structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}}},
        disable_any_whitespace=True, reasoning_end=ReasoningEndRule(7, 8, start_required=True)),
    output_kind=RequestOutputKind.DELTA, allowed_token_ids=[1, 2, 3], bad_words=["foo", "bar"],
    truncate_prompt_tokens=-1, spaces_between_special_tokens=False,
    extra_args={"plugin": {"level": 2.5, "on": [True, None]}})
TOKEN_IDS_ONLY = SamplingParams(min_tokens=2, max_tokens=4, detokenize=False,
                                logprob_token_ids=[4, 9])


def request(params: SamplingParams, **fields) -> EngineCoreRequest:
    return EngineCoreRequest(**{
        "req_id": "r#1", "prompt_token_ids": [1, 2, 3], "sampling_params": params,
        "eos_token_ids": frozenset({0, 5}), "max_tokens": 40, "arrival_time": 1700000000.25,
        "priority": -(2**31), "cache_salt": "tenant-a",
        "bad_words_token_ids": [[11], [12, 13]], **fields})


def test_the_cases_cover_every_sampling_field():
    for f in fields(SamplingParams):
        if not f.init:
            continue
        default = f.default if f.default is not MISSING else f.default_factory()
        assert any(getattr(p, f.name) != default for p in (CONSTRAINED, TOKEN_IDS_ONLY)), f.name


@pytest.mark.parametrize("params", [CONSTRAINED, TOKEN_IDS_ONLY, SamplingParams()])
def test_a_request_crosses_with_every_field(params):
    sent = request(params)
    back = input_decoder.decode(encoder.encode(sent))
    assert type(back) is EngineCoreRequest and back == sent
    for f in sent.__struct_fields__:
        assert getattr(back, f) == getattr(sent, f), f
    got = back.sampling_params
    assert type(got) is SamplingParams and got == params and got.stop_strings == params.stop_strings
    if params.logit_bias:
        assert list(got.logit_bias) == [7, 2**31]  # int keys, not their text
    assert type(back.eos_token_ids) is frozenset
    if params.structured_outputs is not None:
        spec = got.structured_outputs
        assert type(spec.reasoning_end) is ReasoningEndRule
        assert spec.key() == params.structured_outputs.key()
    assert type(got.output_kind) is RequestOutputKind


def test_the_other_inputs_cross():
    for msg in (AbortRequests(["a", "b#0"]), UtilityCall(3, "reset_prefix_cache"), Shutdown()):
        assert input_decoder.decode(encoder.encode(msg)) == msg


def test_sampling_params_are_validated_again_on_arrival():
    raw = msgspec.msgpack.decode(encoder.encode(request(SamplingParams())))
    raw["sampling_params"]["top_p"] = 0.0
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        input_decoder.decode(msgspec.msgpack.encode(raw))


def top(k: int, ranked: bool) -> TopLogprobs:
    ids = np.arange(2 * (1 + k), dtype=np.int64).reshape(2, 1 + k)
    return TopLogprobs(ids, -np.linspace(0, 1, ids.size, dtype=np.float32).reshape(ids.shape),
                       np.array([1, 3], np.int64), ids + 1 if ranked else None)


def test_a_step_crosses_with_every_field():
    stats = SchedulerStats(*range(3), 4, *range(5, 13))
    outputs = [
        EngineCoreOutput("a", [5], None, None, top(2, False), top(4, True), 32, 1700000000.5),
        EngineCoreOutput("b", [6, 7], "stop", 7),
        EngineCoreOutput("c", [], "stop", "END"),
        EngineCoreOutput("d", [], "abort", "error: ValueError: no"),
    ]
    for result in (stats, True, False, None):
        sent = CoreOutputs(outputs, stats, 9, result, "boom" if result is None else None)
        back = output_decoder.decode(encoder.encode(sent))
        assert back.stats == stats and back.utility_result == result
        assert (back.utility_call_id, back.utility_error) == (9, sent.utility_error)
        for got, want in zip(back.outputs, outputs, strict=True):
            for f in ("req_id", "new_token_ids", "finish_reason", "stop_reason",
                      "num_cached_tokens", "first_scheduled_time"):
                assert getattr(got, f) == getattr(want, f), f
            for f in ("logprobs", "prompt_logprobs"):
                g, w = getattr(got, f), getattr(want, f)
                assert (g is None) == (w is None), f
                if w is not None:
                    for name in ("token_ids", "logprobs", "ranks", "token_ranks"):
                        a, b = getattr(g, name), getattr(w, name)
                        assert (a is None and b is None) or (a.dtype == b.dtype
                                                             and np.array_equal(a, b)), name
    assert stats.spec_mean_acceptance_length == 1 + 11 / 12


class _Core:
    def stats(self) -> SchedulerStats:
        return SchedulerStats(0, 0, 0.0, 0)


def test_the_core_process_answers_a_request_it_cannot_decode(tmp_path):
    proc = core_process.EngineCoreProcess(_Core(), f"ipc://{tmp_path}/in",
                                          f"ipc://{tmp_path}/out")
    sent = []
    proc._send = sent.append
    try:
        raw = msgspec.msgpack.decode(encoder.encode(request(SamplingParams())))
        raw["sampling_params"]["top_p"] = 0.0
        proc._receive(msgspec.msgpack.encode(raw))  # answered: the request does not hang
        [answer] = sent
        [out] = answer.outputs
        assert (out.req_id, out.finish_reason) == ("r#1", "abort") and "top_p" in out.stop_reason
        proc._receive(b"\xc1")  # not msgpack at all: dropped, and the loop goes on
        proc._receive(msgspec.msgpack.encode({"type": "Nope"}))
        assert len(sent) == 1
    finally:
        proc.inputs.close(linger=0)
        proc.outputs.close(linger=0)
        proc.ctx.term()
