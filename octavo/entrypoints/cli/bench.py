"""`octavo bench throughput`: offline throughput of octavo, optionally beside other engines.

Every backend runs the same requests for `--repeats` timed runs after one warm-up, interleaved so
that drift hits all alike; medians are reported, with ratios to the first backend. Backends:
`octavo`, `octavo-no-prefix-cache` (the same engine with prefix caching off), `octavo-structured`
(a JSON schema on a fraction of the requests, see bench_structured), `transformers` and
`llama.cpp` (see bench_peers); `--compare` adds the peers that are installed. Workloads come
from bench_data (random, prefix, sharegpt). The engine's memory (weights, RSS, peak RSS:
bench_memory) closes the table and goes in the JSON report.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from dataclasses import dataclass

from octavo.config import EngineConfig, add_engine_args
from octavo.entrypoints.cli import (bench_build_beside, bench_embed, bench_latency, bench_lora,
                                    bench_serve, bench_startup, bench_structured)
from octavo.entrypoints.cli.bench_data import Workload, add_dataset_args, build_workload
from octavo.entrypoints.cli.bench_memory import memory_line, memory_report
from octavo.entrypoints.cli.bench_peers import (LlamaCppBatcher, Run, load_transformers,
                                                NO_REPACK_HELP, time_transformers)

BACKENDS = ("octavo", "octavo-no-prefix-cache", "octavo-structured", "transformers", "llama.cpp")


@dataclass
class Result:
    backend: str
    runs: list[Run]
    num_requests: int
    prompt_tokens: int
    kv: dict | None = None

    def row(self) -> dict:
        secs = statistics.median(r.seconds for r in self.runs)
        out = self.runs[0].output_tokens
        row = {"backend": self.backend, "seconds": round(secs, 3),
               "requests_per_s": round(self.num_requests / secs, 3),
               "output_tokens_per_s": round(out / secs, 2),
               "total_tokens_per_s": round((self.prompt_tokens + out) / secs, 2)}
        if self.runs[0].ttft:
            row["ttft_mean_s"] = round(statistics.median(
                statistics.fmean(r.ttft) for r in self.runs), 4)
            row["ttft_p50_s"] = round(statistics.median(
                statistics.median(r.ttft) for r in self.runs), 4)
        if self.kv:
            row.update(self.kv)
        return row


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    kinds = b.add_subparsers(dest="kind", required=True)
    t = kinds.add_parser("throughput", help="offline throughput")
    t.add_argument("--num-prompts", type=int, default=64)
    add_dataset_args(t, input_len=256, output_len=128)
    t.add_argument("--backends", default="octavo",
                   help=f"comma-separated, run side by side on the same prompts: "
                        f"{', '.join(BACKENDS)}")
    t.add_argument("--compare", action="store_true",
                   help="also run transformers and llama.cpp, where installed")
    t.add_argument("--hf-batch-size", type=int, default=16, help="batch size of transformers")
    t.add_argument("--llama-cpp-seqs", type=int, default=16,
                   help="sequences llama.cpp batches continuously in one KV cache")
    t.add_argument("--llama-cpp-no-repack", action="store_true", help=NO_REPACK_HELP)
    t.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    t.add_argument("--concurrency", default=None,
                   help="comma-separated levels to sweep (octavo's max running requests, "
                        "llama.cpp's sequences, transformers' batch size)")
    t.add_argument("--plot", default=None, help="PNG of total tokens/s against --concurrency")
    t.add_argument("--json", default=None, help="write the results to this file")
    bench_structured.add_args(t)
    add_engine_args(t)
    t.set_defaults(run=run_throughput)
    bench_serve.register(kinds)
    bench_latency.register(kinds)
    bench_lora.register(kinds)
    bench_startup.register(kinds)
    bench_build_beside.register(kinds)
    bench_embed.register(kinds)


def _backends(args: argparse.Namespace, is_gguf: bool) -> list[str]:
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    if args.compare:
        if importlib.util.find_spec("transformers") and "transformers" not in backends:
            backends.append("transformers")
        if is_gguf and importlib.util.find_spec("llama_cpp") and "llama.cpp" not in backends:
            backends.append("llama.cpp")
    if "llama.cpp" in backends and not is_gguf:
        raise ValueError("--backends llama.cpp needs a GGUF model")
    return backends


def _time_octavo(llm, work: Workload, spec=None, fraction: float = 0.0) -> Run:
    engine = llm.engine
    llm.reset_prefix_cache()  # every run starts cold: the same work each time
    start = time.perf_counter()
    pending = {}
    for i, (prompt, out_len) in enumerate(work):
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, bench_structured.request_params(out_len, i, fraction,
                                                                         spec))
        pending[rid] = None
    first: dict[str, float] = {}
    produced = 0
    while pending:
        for out in engine.step():
            if out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = time.perf_counter() - start
            if out.finished:
                produced += len(out.outputs[0].token_ids)
                pending.pop(out.request_id, None)
    return Run(time.perf_counter() - start, produced, list(first.values()))


def _kv_accounting(llm) -> dict:
    """KV slots held by finished requests but never written, and the peak concurrency."""
    s = llm.engine.client.stats()
    waste = s.kv_slots_unwritten / s.kv_slots_allocated if s.kv_slots_allocated else 0.0
    return {"kv_unwritten_fraction": round(waste, 4), "peak_running_requests": s.peak_running}


def _runners(args: argparse.Namespace, config: EngineConfig, llm, backends: list[str],
             prompts: Workload, level: int | None, loaded: dict) -> tuple[dict, dict]:
    """A timing function per backend; `level` (the --concurrency point) caps octavo's running
    requests, llama.cpp's sequences and transformers' batch size alike. `loaded` keeps the
    transformers model across levels."""
    from octavo.llm import LLM

    engines, runners = {}, {}
    spec = bench_structured.spec_from_args(args) if "octavo-structured" in backends else None
    for b in backends:
        if b.startswith("octavo"):
            cfg = config if level is None else config.replace(max_num_seqs=level)
            if b == "octavo-no-prefix-cache":
                cfg = cfg.replace(enable_prefix_caching=False)
            engines[b] = llm if cfg == config else LLM.from_config(cfg)
            b_spec, fraction = (spec, args.structured_fraction) if b == "octavo-structured" \
                else (None, 0.0)
            runners[b] = (lambda e, s, f: lambda ps: _time_octavo(e, ps, s, f))(
                engines[b], b_spec, fraction)
        elif b == "transformers":
            if "transformers" not in loaded:
                loaded["transformers"] = load_transformers(llm)
            hf = loaded["transformers"]
            size = level or args.hf_batch_size
            runners[b] = lambda ps: time_transformers(hf, ps, size)
        else:
            longest = max(len(p) + n for p, n in prompts)
            cpp = LlamaCppBatcher(str(llm.engine.source.path), config.device.num_threads,
                                  level or args.llama_cpp_seqs, longest + 1,
                                  no_repack=args.llama_cpp_no_repack)
            runners[b] = cpp.run
            engines[b] = cpp
    return engines, runners


def _measure(args: argparse.Namespace, config: EngineConfig, llm, backends: list[str],
             prompts: Workload, level: int | None, loaded: dict) -> list[Result]:
    engines, runners = _runners(args, config, llm, backends, prompts, level, loaded)
    runs: dict[str, list[Run]] = {b: [] for b in backends}
    for b in backends:  # warm-up
        runners[b](prompts[:2])
    for _ in range(args.repeats):
        for b in backends:
            runs[b].append(runners[b](prompts))
    n_prompt = sum(len(p) for p, _ in prompts)
    results = [Result(b, runs[b], len(prompts), n_prompt,
                      _kv_accounting(engines[b]) if b.startswith("octavo") else None)
               for b in backends]
    if "llama.cpp" in engines:
        engines["llama.cpp"].close()  # each level builds its own context
    return results


def _print(results: list[Result], repeats: int, level: int | None) -> dict:
    """Print one table; returns the ratios of the first backend to the others."""
    if level is not None:
        print(f"concurrency {level}:")
    for r in results:
        row = r.row()
        line = (f"{r.backend:>24}: {row['requests_per_s']:.2f} requests/s, "
                f"{row['output_tokens_per_s']:.1f} output tokens/s, "
                f"{row['total_tokens_per_s']:.1f} total tokens/s")
        if "ttft_mean_s" in row:
            line += f", TTFT mean {row['ttft_mean_s']:.3f} s"
        if "kv_unwritten_fraction" in row:
            line += (f", KV slots never written {100 * row['kv_unwritten_fraction']:.2f}%, "
                     f"peak {row['peak_running_requests']} running")
        print(line + f" (median of {repeats})")
    base = results[0].row()
    ratios = {}
    for r in results[1:]:
        row = r.row()
        ratios[f"{results[0].backend}_speedup_over_{r.backend}"] = round(
            row["seconds"] / base["seconds"], 3)
        msg = f"{results[0].backend} is {row['seconds'] / base['seconds']:.2f}x the throughput " \
              f"of {r.backend}"
        if "ttft_mean_s" in row and "ttft_mean_s" in base:
            msg += f"; TTFT {row['ttft_mean_s'] / base['ttft_mean_s']:.2f}x lower"
        print(msg)
    return ratios


def run_throughput(args: argparse.Namespace) -> int:
    from octavo.llm import LLM

    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    levels = _levels(args.concurrency)
    if args.plot and levels == [None]:
        raise ValueError("--plot needs --concurrency (the x axis), e.g. --concurrency 1,4,16")
    config = EngineConfig.from_cli(args)
    llm = LLM.from_config(config)
    backends = _backends(args, llm.engine.source.is_gguf)
    prompts = build_workload(args, llm.engine.arch.vocab_size, set(llm.tokenizer.all_special_ids),
                             llm.tokenizer, llm.engine.setup.max_model_len)
    report = {"dataset": args.dataset, "dataset_path": args.dataset_path,
              "num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len,
              "prefix_len": args.prefix_len if args.dataset == "prefix" else 0,
              "range_ratio": args.range_ratio, "dataset_seed": args.dataset_seed,
              "prompt_tokens": sum(len(p) for p, _ in prompts),
              "output_tokens": sum(n for _, n in prompts), "repeats": args.repeats}
    if "octavo-structured" in backends:  # before any run compiles the schema
        times = bench_structured.compile_times(llm, bench_structured.spec_from_args(args))
        report.update(times, structured_fraction=args.structured_fraction,
                      json_schema=args.json_schema)
        print(f"grammar compile {times['grammar_compile_s']:.3f} s; time to first token "
              f"{times['ttft_no_grammar_s']:.3f} s without a grammar, "
              f"{times['ttft_new_grammar_s']:.3f} s with a new one, "
              f"{times['ttft_cached_grammar_s']:.3f} s with it cached (medians of 3)")
    sweep, loaded = [], {}
    for level in levels:
        results = _measure(args, config, llm, backends, prompts, level, loaded)
        ratios = _print(results, args.repeats, level)
        point = {"runs_seconds": {r.backend: [round(x.seconds, 3) for x in r.runs]
                                  for r in results},
                 "results": [r.row() for r in results], **ratios}
        if level is None:
            report.update(point)
        else:
            sweep.append({"concurrency": level, **point})
    if sweep:
        report["sweep"] = sweep
    report["memory"] = memory_report(llm)  # peak: of every backend run in this process
    print(memory_line(report["memory"]))
    if args.plot:
        from octavo.entrypoints.cli.bench_plot import plot_sweep

        plot_sweep(report, args.plot)
        print(f"plot written to {args.plot}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _levels(text: str | None) -> list[int | None]:
    if not text:
        return [None]
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency: expected comma-separated integers, got {text!r}") \
            from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency: levels must be >= 1, got {text!r}")
    return levels
