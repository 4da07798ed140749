"""`octavo bench latency`: one request at a time; time to first token, time per output token
and end-to-end latency percentiles, optionally beside llama.cpp (`llama-cpp-python`) on the same
GGUF and thread count. The table ends with the engine's memory (bench_memory: weights, RSS, peak
RSS), so modes such as --quantization int4 can be compared."""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from octavo.config import EngineConfig, add_engine_args
from octavo.entrypoints.cli.bench_memory import memory_line, memory_report
from octavo.entrypoints.cli.bench_peers import NO_REPACK_HELP, LlamaCaller, llama_model_params


def register(kinds: argparse._SubParsersAction) -> None:
    t = kinds.add_parser("latency", help="single-request latency")
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--num-iters", type=int, default=5, help="timed requests (after one warm-up)")
    t.add_argument("--repeat-period", type=int, default=0,
                   help="a repetitive prompt: this many random tokens repeated up to --input-len "
                        "(where n-gram speculation finds its drafts); 0: all random")
    t.add_argument("--backends", default="octavo",
                   help="comma-separated: octavo, llama.cpp (needs llama-cpp-python and a GGUF)")
    t.add_argument("--llama-cpp-no-repack", action="store_true", help=NO_REPACK_HELP)
    t.add_argument("--json", default=None)
    add_engine_args(t)
    t.set_defaults(run=run)


def _octavo_once(llm, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    from octavo.params import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    rid = engine.next_request_id()
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True,
                                                   temperature=0))
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    return start, stamps


def _llama_cpp_once(model, prompt: list[int], output_len: int) -> tuple[float, list[float]]:
    model.reset()
    start = time.perf_counter()
    stamps = []
    for i, _ in enumerate(model.generate(prompt, temp=0.0, reset=True)):
        stamps.append(time.perf_counter())
        if i + 1 >= output_len:
            break
    return start, stamps


def _summary(samples: list[tuple[float, list[float]]]) -> dict:
    ttft = np.array([s[1][0] - s[0] for s in samples])
    tpot = np.array([(s[1][-1] - s[1][0]) / (len(s[1]) - 1) for s in samples if len(s[1]) > 1])
    e2e = np.array([s[1][-1] - s[0] for s in samples])

    def pct(a: np.ndarray) -> dict:
        return {f"p{q}_ms": round(float(np.percentile(a, q)) * 1000, 2) for q in (50, 90, 99)}

    return {"ttft": pct(ttft), "tpot": pct(tpot), "e2e": pct(e2e),
            "decode_tokens_per_s": round(1.0 / statistics.median(tpot.tolist()), 2),
            "prefill_tokens_per_s": None}


def run(args: argparse.Namespace) -> int:
    from octavo.llm import LLM

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("octavo", "llama.cpp"):
            raise ValueError(f"--backends: unknown backend {b!r}")
    if args.num_iters < 1 or args.output_len < 2:
        raise ValueError("--num-iters must be >= 1 and --output-len >= 2")
    if args.repeat_period < 0:
        raise ValueError(f"--repeat-period must be >= 0, got {args.repeat_period}")
    llm = LLM.from_config(EngineConfig.from_cli(args))
    rng = np.random.default_rng(0)
    special = set(llm.tokenizer.all_special_ids)
    allowed = [t for t in range(llm.engine.arch.vocab_size) if t not in special]
    prompt = rng.choice(allowed, args.input_len).tolist()
    if args.repeat_period:
        prompt = (prompt[:args.repeat_period] * args.input_len)[:args.input_len]
    runners = {"octavo": lambda: _octavo_once(llm, prompt, args.output_len)}
    if "llama.cpp" in backends:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise ValueError("--backends llama.cpp needs `pip install llama-cpp-python`") from None
        if not llm.engine.source.is_gguf:
            raise ValueError("--backends llama.cpp needs a GGUF model")
        threads = llm.engine.config.device.num_threads or __import__("os").cpu_count()
        call = LlamaCaller.for_llama(args.llama_cpp_no_repack)
        with llama_model_params(args.llama_cpp_no_repack):
            cpp = call(Llama, str(llm.engine.source.path),
                       n_ctx=args.input_len + args.output_len + 8, n_threads=threads,
                       n_threads_batch=threads, n_batch=512, verbose=False)
        runners["llama.cpp"] = lambda: call(_llama_cpp_once, cpp, prompt, args.output_len)
    samples: dict[str, list] = {b: [] for b in backends}
    for b in backends:
        runners[b]()  # warm-up
    for _ in range(args.num_iters):
        for b in backends:
            samples[b].append(runners[b]())
    report = {"input_len": args.input_len, "output_len": args.output_len,
              "num_iters": args.num_iters, "results": {}}
    for b in backends:
        s = _summary(samples[b])
        s["prefill_tokens_per_s"] = round(args.input_len / (s["ttft"]["p50_ms"] / 1000), 1)
        report["results"][b] = s
        print(f"{b:>10}: TTFT p50 {s['ttft']['p50_ms']} ms (prefill "
              f"{s['prefill_tokens_per_s']} tokens/s), TPOT p50 {s['tpot']['p50_ms']} ms "
              f"(decode {s['decode_tokens_per_s']} tokens/s), e2e p50 {s['e2e']['p50_ms']} ms")
    stats = llm.engine.client.stats()
    if stats.spec_num_drafts:
        report["spec_mean_acceptance_length"] = round(stats.spec_mean_acceptance_length, 3)
        report["spec_draft_tokens"] = stats.spec_draft_tokens
        report["spec_accepted_tokens"] = stats.spec_accepted_tokens
        print(f"speculative: {stats.spec_accepted_tokens} of {stats.spec_draft_tokens} draft "
              f"tokens accepted, mean acceptance length "
              f"{stats.spec_mean_acceptance_length:.2f}")
    report["memory"] = memory_report(llm)  # peak: of every backend run in this process
    print(memory_line(report["memory"]))
    if len(backends) > 1:
        a, b = (report["results"][x] for x in backends[:2])
        print(f"{backends[0]} / {backends[1]}: decode {a['decode_tokens_per_s'] / b['decode_tokens_per_s']:.2f}x, "
              f"prefill {a['prefill_tokens_per_s'] / b['prefill_tokens_per_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
