"""Structured output in `octavo bench throughput`: the `octavo-structured` backend runs the same
requests with a JSON schema on a fraction of them (`--structured-fraction`, `--json-schema`), so
its throughput beside plain `octavo` is the cost of constrained decoding; and the time a schema
takes to compile the first time and when cached.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from octavo.params import SamplingParams, StructuredOutputsParams

# Arrays of at least 200 items: no output of a benchmark's length completes the grammar, so
# constrained requests produce as many tokens as unconstrained ones.
DEFAULT_SCHEMA = {"type": "object", "properties": {"items": {
    "type": "array", "minItems": 200, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "kind": {"enum": ["tool", "food", "book", "toy"]},
        "qty": {"type": "integer", "minimum": 0, "maximum": 1000}},
        "required": ["name", "kind", "qty"]}}}, "required": ["items"]}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--structured-fraction", type=float, default=0.5,
                   help="share of the requests backend octavo-structured constrains (0-1)")
    p.add_argument("--json-schema", default=None,
                   help="JSON schema file for octavo-structured (default: a long array of "
                        "objects that no benchmark output completes)")


def spec_from_args(args: argparse.Namespace) -> StructuredOutputsParams:
    if not 0.0 <= args.structured_fraction <= 1.0:
        raise ValueError(f"--structured-fraction must be in [0, 1], got "
                         f"{args.structured_fraction}")
    schema = DEFAULT_SCHEMA
    if args.json_schema:
        with open(args.json_schema) as f:
            schema = json.load(f)
    return StructuredOutputsParams(json=schema)


def request_params(out_len: int, index: int, fraction: float,
                   spec: StructuredOutputsParams | None) -> SamplingParams:
    """Greedy, ignore_eos; request `index` carries the schema when it falls in the fraction
    (spread evenly: with 0.5, every other request)."""
    constrained = spec is not None and int((index + 1) * fraction) > int(index * fraction)
    return SamplingParams(max_tokens=out_len, ignore_eos=True, temperature=0,
                          structured_outputs=spec if constrained else None)


def compile_times(llm, spec: StructuredOutputsParams, repeats: int = 3) -> dict:
    """Medians over `repeats`: seconds to compile `spec` on a fresh compiler, and the time to
    first token of a one-token request without a grammar, with `spec` new to the engine (each
    repeat retitles the schema, so it compiles again) and with it cached."""
    backend = llm.engine.setup.grammar_backend()
    engine = llm.engine
    prompt = llm.tokenizer.encode("Reply in JSON.")

    def ttft(structured: StructuredOutputsParams | None) -> float:
        rid = engine.next_request_id()
        start = time.perf_counter()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=1,
                                                       structured_outputs=structured))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    ttft(StructuredOutputsParams(choice=["warm-up"]))  # loads the vocabulary into xgrammar
    times: dict[str, list[float]] = {"grammar_compile_s": [], "ttft_no_grammar_s": [],
                                     "ttft_new_grammar_s": [], "ttft_cached_grammar_s": []}
    for i in range(repeats):
        fresh = StructuredOutputsParams(json={**json.loads(spec.key()[1]),
                                              "title": f"bench {i} {time.time()}"})
        start = time.perf_counter()
        backend.compile(fresh)
        times["grammar_compile_s"].append(time.perf_counter() - start)
        times["ttft_no_grammar_s"].append(ttft(None))
        times["ttft_new_grammar_s"].append(ttft(fresh))
        times["ttft_cached_grammar_s"].append(ttft(fresh))
    return {k: round(statistics.median(v), 4) for k, v in times.items()}
