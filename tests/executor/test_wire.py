"""The mp executor's messages: SchedulerOutput and ModelOutput (SamplingParams with structured
outputs, numpy bitmasks and logprobs inside) and a worker's start-up spec come back as they went,
typed, through msgspec alone."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.contract import (
    CachedRequestData,
    GrammarBitmask,
    ModelOutput,
    NewRequestData,
    SchedulerOutput,
    TopLogprobs,
)
from octavo.executor import wire
from octavo.model_source import ModelSource
from octavo.params import ReasoningEndRule, SamplingParams, StructuredOutputsParams


def _with(cls, **given):
    """`cls` built from `given`, list fields it does not name left empty (the contract grows)."""
    missing = {f.name: [] for f in dataclasses.fields(cls) if f.name not in given
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return cls(**given, **missing)


def _scheduler_output() -> SchedulerOutput:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    params = SamplingParams(
        temperature=0.7, top_k=5, seed=-3, logit_bias={17: -2.5}, stop=["\n\n", "END"],
        max_tokens=None, logprobs=4, allowed_token_ids=[1, 2, 17], extra_args={"k": [1, "x"]},
        structured_outputs=StructuredOutputsParams(
            json=schema, disable_any_whitespace=True,
            reasoning_end=ReasoningEndRule(5, 6, start_required=True)))
    new = _with(NewRequestData, req_id="r1", token_ids=[1, 2, 3], num_prompt_tokens=3,
                sampling_params=params, block_ids=[4, 9], num_computed_tokens=0)
    cached = _with(CachedRequestData, req_id="r0", new_block_ids=[7], num_computed_tokens=12)
    bitmask = np.array([[-1, 5], [0, 2**31 - 1]], dtype=np.int32)
    return SchedulerOutput([new], [cached], {"r0": 2, "r1": 3}, 5, finished_req_ids={"gone"},
                           preempted_req_ids={"p"},
                           grammar=GrammarBitmask(["r1", "r1"], bitmask),
                           spec_token_ids={"r0": [8]})


def test_a_scheduler_output_comes_back_whole_and_typed():
    sched = _scheduler_output()
    data = wire.encoder.encode(wire.Execute(3, sched))
    call = wire.call_decoder.decode(data)
    assert isinstance(call, wire.Execute) and call.call_id == 3
    got = call.scheduler_output
    assert wire.encoder.encode(wire.Execute(3, got)) == data
    (new,) = got.new_requests
    assert isinstance(new, NewRequestData) and isinstance(got.cached_requests[0],
                                                          CachedRequestData)
    params = new.sampling_params
    assert params == sched.new_requests[0].sampling_params
    assert params.stop_strings == ["\n\n", "END"] and params.logit_bias == {17: -2.5}
    assert isinstance(params.structured_outputs, StructuredOutputsParams)
    assert params.structured_outputs.reasoning_end == ReasoningEndRule(5, 6, True)
    assert params.structured_outputs.key() == sched.new_requests[0].sampling_params \
        .structured_outputs.key()
    assert got.finished_req_ids == {"gone"} and got.preempted_req_ids == {"p"}
    assert got.num_scheduled_tokens == {"r0": 2, "r1": 3}  # batch order kept
    assert list(got.num_scheduled_tokens) == ["r0", "r1"]
    mask = got.grammar.bitmask
    assert mask.dtype == np.int32 and mask.flags.writeable
    np.testing.assert_array_equal(mask, sched.grammar.bitmask)


def test_a_model_output_comes_back_with_its_arrays():
    rng = np.random.default_rng(0)
    top = TopLogprobs(rng.integers(0, 1000, (3, 5)), rng.standard_normal((3, 5), np.float32),
                      np.array([1, 4, 2]), rng.integers(1, 9, (3, 5)))
    out = ModelOutput(["a", "b"], [[np.int64(5)], []], logprobs={"a": top},
                      prompt_logprobs={"b": top.select(slice(0, 2), 2)},
                      draft_token_ids={"a": [1, 2]})
    reply = wire.reply_decoder.decode(wire.encoder.encode(wire.ExecuteReply(0, 9, out)))
    assert isinstance(reply, wire.ExecuteReply) and reply.error is None
    got = reply.output
    assert got.req_ids == ["a", "b"] and got.sampled_token_ids == [[5], []]
    assert got.draft_token_ids == {"a": [1, 2]}
    for mine, theirs in ((got.logprobs["a"], top), (got.prompt_logprobs["b"],
                                                    top.select(slice(0, 2), 2))):
        for name in ("token_ids", "logprobs", "ranks", "token_ranks"):
            a, b = getattr(mine, name), getattr(theirs, name)
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    none = wire.reply_decoder.decode(wire.encoder.encode(wire.ExecuteReply(1, 9)))
    assert none.output is None


def test_replies_carry_values_and_errors():
    for value in (None, True, 12345678901, "LlamaForCausalLM, float32"):
        reply = wire.reply_decoder.decode(wire.encoder.encode(wire.Reply(2, 4, value)))
        assert reply == wire.Reply(2, 4, value) and type(reply.value) is type(value)
    error = wire.Reply(1, 4, error="Traceback ...\nValueError: x")
    assert wire.reply_decoder.decode(wire.encoder.encode(error)) == error


def test_a_worker_spec_comes_back_equal():
    config = EngineConfig.from_kwargs(model="m", max_num_seqs=3, tensor_parallel_size=2,
                                      kv_cache_dtype="fp8_e4m3",
                                      speculative_config={"method": "ngram"})
    arch = ArchConfig("LlamaForCausalLM", 100, 64, 128, 2, 4, 2, 16, 256,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0},
                      eos_token_ids=(1, 2), layer_types=("full_attention",) * 2,
                      sampling_defaults={"temperature": 0.6})
    spec = wire.WorkerSpec(1, 2, 1, 0, 1, "tcp://127.0.0.1:1234", 20, config,
                           ModelSource("m", Path("/models/m.gguf")), arch, 256, [1, 2])
    got = wire.spec_decoder.decode(wire.encoder.encode(spec))
    assert got == spec
    start = wire.ProcessStart("ipc:///tmp/x", 99, spec)
    assert wire.start_decoder.decode(wire.encoder.encode(start)) == start
    assert isinstance(got.source.path, Path) and got.source.is_gguf
    assert got.config.parallel.tensor_parallel_size == 2 and got.arch.eos_token_ids == (1, 2)
