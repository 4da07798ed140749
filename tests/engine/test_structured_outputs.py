"""Structured output on the real SmolLM2: JSON schemas, regexes, choices and EBNF grammars hold
for greedy and sampled decoding, n > 1, batched beside unconstrained requests (which stay
unchanged), max_tokens cut-offs, stop strings, chunked prefill and preemption; bad specs are
refused up front and the engine keeps serving."""
from __future__ import annotations

import argparse
import json
import math
import re

import jsonschema
import numpy as np
import pytest
import torch

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.engine.grammar import XgrammarBackend
from octavo.worker.sampler import apply_token_bitmask, byte_mask_table

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"]},
        "city": {"type": "string", "maxLength": 20}}, "required": ["person", "city"]},
    "array": {"type": "object", "properties": {"colors": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1,
        "maxItems": 3}}, "required": ["colors"]},
    "enum": {"type": "object", "properties": {
        "sentiment": {"enum": ["positive", "negative", "neutral"]},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["sentiment", "confidence"]},
    "pattern": {"type": "object", "properties": {
        "phone": {"type": "string", "pattern": "^[0-9]{3}-[0-9]{4}$"},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["phone", "zip"]},
    "bounds": {"type": "object", "properties": {
        "temperature": {"type": "integer", "minimum": -30, "maximum": 45},
        "ratio": {"type": "number", "exclusiveMinimum": 0, "maximum": 10},
        "ok": {"type": "boolean"}}, "required": ["temperature", "ratio", "ok"]},
    "list_of_objects": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1}, "tag": {"type": "string", "enum": ["a", "b"]}},
        "required": ["id", "tag"]}, "minItems": 1, "maxItems": 2},
}
GREEDY = dict(temperature=0.0)
SAMPLED = dict(temperature=1.0, seed=7)
# Two numbers in parentheses, each of at most three digits.
PAIR_GRAMMAR = 'root ::= "(" num ", " num ")"\nnum ::= [0-9] | [0-9] [0-9] | [0-9] [0-9] [0-9]'


def chat(llm, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def params(spec: StructuredOutputsParams, max_tokens: int = 100, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=spec, **kw)


def test_json_schemas_hold_greedy_and_sampled(smollm_llm):
    prompts, ps = [], []
    for name, schema in SCHEMAS.items():
        prompt = chat(smollm_llm, f"Reply in JSON with an example of {name}.")
        prompts += [prompt, prompt]
        ps += [params(StructuredOutputsParams(json=schema), **GREEDY),
               params(StructuredOutputsParams(json=json.dumps(schema),
                                              disable_any_whitespace=True), **SAMPLED)]
    for schema, p, out in zip([s for s in SCHEMAS.values() for _ in (0, 1)], ps,
                              smollm_llm.generate(prompts, ps, use_tqdm=False)):
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
        if p.structured_outputs.disable_any_whitespace:
            assert "\n" not in c.text


def test_regex_choice_grammar_and_json_object(smollm_llm):
    cases = [
        (StructuredOutputsParams(regex=r"[0-9]{3}-[0-9]{4}"), "A phone number:",
         lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
        (StructuredOutputsParams(regex=r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)"), "An email:",
         lambda t: re.fullmatch(r"[a-z]{2,8}@[a-z]{2,8}\.(com|org)", t)),
        (StructuredOutputsParams(regex=r"#[0-9a-f]{6}"), "A color in hex:",
         lambda t: re.fullmatch(r"#[0-9a-f]{6}", t)),
        (StructuredOutputsParams(choice=["positive", "negative", "a \"quoted\" one"]),
         "Is 'I love it' positive or negative?",
         lambda t: t in ("positive", "negative", 'a "quoted" one')),
        (StructuredOutputsParams(grammar=PAIR_GRAMMAR), "Two numbers:",
         lambda t: re.fullmatch(r"\([0-9]{1,3}, [0-9]{1,3}\)", t)),
        (StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
         "A JSON object with the keys x and y:", lambda t: isinstance(json.loads(t), dict)),
        (StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
            "type": "tag", "begin": "<age>", "end": "</age>", "content": {
                "type": "json_schema", "json_schema": {"type": "integer", "minimum": 0,
                                                       "maximum": 99}}}}),
         "How old is a cat?", lambda t: re.fullmatch(r"<age>\s*[0-9]{1,2}\s*</age>", t)),
    ]
    prompts, ps, checks = [], [], []
    for spec, text, check in cases:
        for kw in (GREEDY, SAMPLED):
            prompts.append(chat(smollm_llm, text))
            ps.append(params(spec, max_tokens=60, **kw))
            checks.append(check)
    for out, check in zip(smollm_llm.generate(prompts, ps, use_tqdm=False), checks):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text


def test_unconstrained_requests_are_unchanged_beside_constrained_ones(smollm_llm):
    free = [chat(smollm_llm, "Name three fruits."), chat(smollm_llm, "What is 2 + 2?")]
    plain = SamplingParams(max_tokens=20, temperature=0)
    seeded = SamplingParams(max_tokens=20, temperature=0.8, seed=3)
    alone = smollm_llm.generate(free, [plain, seeded], use_tqdm=False)
    spec = StructuredOutputsParams(json=SCHEMAS["nested"])
    mixed = smollm_llm.generate(
        [free[0], chat(smollm_llm, "A person as JSON."), free[1], free[0]],
        [plain, params(spec, max_tokens=60, **SAMPLED), seeded,
         params(StructuredOutputsParams(choice=["yes", "no"]), max_tokens=5)], use_tqdm=False)
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids
    jsonschema.validate(json.loads(mixed[1].outputs[0].text), SCHEMAS["nested"])
    assert mixed[3].outputs[0].text in ("yes", "no")


def test_n_samples_each_follow_the_schema(smollm_llm):
    schema = SCHEMAS["enum"]
    out = smollm_llm.generate(
        chat(smollm_llm, "Rate the sentiment of 'great food' as JSON."),
        params(StructuredOutputsParams(json=schema, disable_any_whitespace=True), n=4,
               temperature=1.2, seed=11), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1


def test_max_tokens_cut_is_length_and_a_valid_prefix(smollm_llm):
    spec = StructuredOutputsParams(json=SCHEMAS["nested"])
    c = smollm_llm.generate(chat(smollm_llm, "A person as JSON."),
                            params(spec, max_tokens=6, **GREEDY), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    backend = XgrammarBackend(smollm_llm.tokenizer, smollm_llm.engine.arch.vocab_size, [2])
    matcher = backend.matcher(backend.compile(spec))
    assert all(matcher.accept_token(t) for t in c.token_ids)
    assert not matcher.is_terminated()


def test_stop_string_ends_a_constrained_request(smollm_llm):
    spec = StructuredOutputsParams(json=SCHEMAS["nested"], disable_any_whitespace=True)
    c = smollm_llm.generate(chat(smollm_llm, "A person as JSON."),
                            params(spec, stop=[","], **GREEDY), use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == ","
    assert c.text.startswith('{"person"') and "," not in c.text


def test_logprobs_are_those_within_the_grammar(smollm_llm):
    c = smollm_llm.generate(
        chat(smollm_llm, "Is 'I love it' positive or negative?"),
        params(StructuredOutputsParams(choice=["positive", "negative"]), logprobs=5, **GREEDY),
        use_tqdm=False)[0].outputs[0]
    first = c.logprobs[0]
    finite = {t: lp for t, lp in first.items() if lp.logprob > -math.inf}
    assert c.token_ids[0] in finite
    assert all("positive".startswith(lp.decoded_token) or "negative".startswith(
        lp.decoded_token) for lp in finite.values())
    # Renormalized over the few tokens that start a choice: the top 5 hold most of the mass.
    assert 0.5 < sum(math.exp(lp.logprob) for lp in finite.values()) <= 1.0 + 1e-4


@pytest.mark.parametrize("spec, fragment", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nope"}}}),
     "structured_outputs.json is not a usable JSON schema"),
    (dict(json={"$ref": "#/$defs/missing"}), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex is not a valid regular expression"),
    (dict(grammar="root ::= undefined_rule"), "structured_outputs.grammar is not a valid EBNF"),
    (dict(structural_tag={"type": "structural_tag", "format": {"type": "bogus"}}),
     "structured_outputs.structural_tag"),
])
def test_bad_specs_are_refused_and_the_engine_keeps_serving(smollm_llm, spec, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        smollm_llm.generate("Hi", SamplingParams(
            max_tokens=4, structured_outputs=StructuredOutputsParams(**spec)), use_tqdm=False)
    assert not smollm_llm.engine.has_unfinished_requests()
    out = smollm_llm.generate("The capital of France is", SamplingParams(
        max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(), "exactly one of"),
    (dict(json={}, regex="a"), "json and regex"),
    (dict(json="{not json"), "structured_outputs.json is not valid JSON"),
    (dict(json=[1]), "structured_outputs.json must be a JSON object"),
    (dict(choice=[]), "structured_outputs.choice"),
    (dict(choice=["a", 1]), "structured_outputs.choice"),
    (dict(regex=""), "structured_outputs.regex"),
    (dict(json_object="yes"), "structured_outputs.json_object must be a bool"),
])
def test_params_validation_names_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        StructuredOutputsParams(**kwargs)


def test_min_tokens_and_structured_outputs_are_exclusive():
    with pytest.raises(ValueError, match="min_tokens must be 0 with structured_outputs"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+"))


def test_apply_token_bitmask_matches_a_reference():
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 100, torch.tensor([2, 0])
    logits = torch.randn(3, vocab, generator=gen)
    allowed = torch.rand(2, vocab, generator=gen) > 0.7
    bits = np.zeros((2, 128), np.uint8)
    bits[:, :vocab] = allowed.numpy()
    bitmask = torch.from_numpy(np.packbits(bits, axis=1, bitorder="little").view(np.int32))
    expected = logits.clone()
    expected[rows] = torch.where(allowed, logits[rows], float("-inf"))
    apply_token_bitmask(logits, rows, bitmask, byte_mask_table())
    assert torch.equal(logits, expected)  # row 1 has no grammar: untouched


def test_chunked_prefill_and_preemption_keep_the_grammar(smollm_gguf):
    # Chunks of 32 tokens and a KV cache of 24 blocks (384 tokens) for 6 requests of ~100
    # tokens each: prompts are prefilled in several steps and requests get preempted.
    llm = LLM(str(smollm_gguf), dtype="float32", max_model_len=384, max_num_seqs=6,
              max_num_batched_tokens=32, kv_cache_memory=24 * 16 * 2 * 3 * 64 * 30 * 4)
    schema = SCHEMAS["list_of_objects"]
    prompts = [chat(llm, f"Note {i}. " + "Some background first. " * 6 + "Now list two tagged "
                    "items as JSON.") for i in range(6)]  # distinct: no shared prefix blocks
    outs = llm.generate(prompts, [params(StructuredOutputsParams(
        json=schema, disable_any_whitespace=True), max_tokens=40, temperature=1.0, seed=i)
        for i in range(6)], use_tqdm=False)
    assert llm.engine.client.stats().num_preemptions > 0
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_bench_structured_backend(smollm_llm):
    from octavo.entrypoints.cli import bench, bench_structured

    with pytest.raises(ValueError, match="--structured-fraction"):
        bench_structured.spec_from_args(argparse.Namespace(structured_fraction=1.5,
                                                           json_schema=None))
    spec = bench_structured.spec_from_args(argparse.Namespace(structured_fraction=0.5,
                                                              json_schema=None))
    ps = [bench_structured.request_params(4, i, 0.5, spec) for i in range(4)]
    assert [p.structured_outputs is spec for p in ps] == [False, True, False, True]
    times = bench_structured.compile_times(smollm_llm, spec, repeats=1)
    assert set(times) == {"grammar_compile_s", "ttft_no_grammar_s", "ttft_new_grammar_s",
                          "ttft_cached_grammar_s"}
    assert all(t > 0 for t in times.values())
    # ignore_eos and a schema no short output completes: every request runs to max_tokens.
    run = bench._time_octavo(smollm_llm, [(smollm_llm.tokenizer.encode("Items:"), 5)] * 4,
                             spec, 0.5)
    assert run.output_tokens == 20


def test_grammar_waits_for_the_end_of_reasoning_on_the_real_model(smollm_llm):
    # SmolLM2 has no <think> tokens, so a token it writes early on stands in for </think>: the
    # tokens up to it are the model's free choice (the same as unconstrained, greedy), and what
    # follows is JSON valid against the schema.
    from octavo.params import ReasoningEndRule

    prompt = chat(smollm_llm, "Describe a person as JSON.")
    free = smollm_llm.generate([prompt], params(None, max_tokens=8, **GREEDY),
                               use_tqdm=False)[0].outputs[0].token_ids
    end = next(i for i in range(2, len(free)) if free[i] not in free[:i])
    rule = ReasoningEndRule(start_id=free[0], end_id=free[end], start_required=False)
    schema = SCHEMAS["nested"]
    out = smollm_llm.generate([prompt], params(StructuredOutputsParams(
        json=schema, reasoning_end=rule), **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:end + 1] == free[:end + 1]
    answer = smollm_llm.tokenizer.decode(out.token_ids[end + 1:], skip_special_tokens=True)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(answer), schema)


def test_reasoning_gate_crosses_to_the_core_process():
    from octavo.core.protocol import EngineCoreRequest
    from octavo.engine.messages import encoder, input_decoder
    from octavo.params import ReasoningEndRule

    rule = ReasoningEndRule(7, 8, start_required=True)
    spec = StructuredOutputsParams(json={"type": "object"}, reasoning_end=rule)
    req = EngineCoreRequest("r", [1, 2], SamplingParams(structured_outputs=spec), frozenset({0}),
                            16, 0.0)
    back = input_decoder.decode(encoder.encode(req))
    got = back.sampling_params.structured_outputs
    assert got.reasoning_end == rule and got.key() == spec.key()
    assert StructuredOutputsParams(json={"type": "object"}).key() == spec.key()


def test_json_whitespace_runs_are_bounded_unless_compact():
    """A JSON grammar allows pretty-printing, but no run of free whitespace past
    MAX_JSON_WHITESPACE characters (the runaway-newlines failure); compact allows none."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from octavo.engine.grammar import MAX_JSON_WHITESPACE, build_grammar

    pretty = '{\n    "a": [\n        1,\n        2\n    ]\n}'
    runaway = "{" + "\n" * (MAX_JSON_WHITESPACE + 1) + '"a": 1}'
    for spec in (StructuredOutputsParams(json_object=True),
                 StructuredOutputsParams(json={"type": "object", "properties": {
                     "a": {"type": "array", "items": {"type": "integer"}}}})):
        grammar = build_grammar(spec.key())
        assert accepts(grammar, pretty) and accepts(grammar, '{"a": [1, 2]}')
        assert not accepts(grammar, runaway)
        compact = build_grammar(StructuredOutputsParams(
            **{**spec.to_dict(), "disable_any_whitespace": True}).key())
        assert not accepts(compact, pretty)  # one fixed separator style, no free whitespace
        assert accepts(compact, '{"a":[1,2]}') or accepts(compact, '{"a": [1, 2]}')
