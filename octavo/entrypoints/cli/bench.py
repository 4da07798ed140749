"""`octavo bench throughput`: offline throughput of octavo, optionally beside other backends.

Every backend runs the same prompts for `--repeats` timed runs after one warm-up, interleaved so
that drift hits all alike; medians are reported, with ratios to the first backend. Backends:
`octavo`, `octavo-no-prefix-cache` (the same engine with prefix caching off) and `transformers`
(batched `generate`). Datasets: `random` (seeded token ids, fixed lengths) and `prefix` (one
shared `--prefix-len` system prompt + distinct `--input-len` suffixes).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from octavo.config import EngineConfig, add_engine_args
from octavo.entrypoints.cli import bench_latency, bench_serve

BACKENDS = ("octavo", "octavo-no-prefix-cache", "transformers")


@dataclass
class Run:
    seconds: float
    output_tokens: int
    ttft: list[float] = field(default_factory=list)  # per request, octavo backends only


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
    t.add_argument("--input-len", type=int, default=256,
                   help="prompt tokens (with --dataset prefix: the distinct suffix)")
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--dataset", choices=["random", "prefix"], default="random")
    t.add_argument("--prefix-len", type=int, default=1024, help="shared prefix of --dataset prefix")
    t.add_argument("--range-ratio", type=float, default=0.0,
                   help="input and output lengths uniform in [L(1-r), L(1+r)] (seeded)")
    t.add_argument("--backends", default="octavo",
                   help=f"comma-separated, run side by side on the same prompts: "
                        f"{', '.join(BACKENDS)}")
    t.add_argument("--hf-batch-size", type=int, default=16, help="batch size of transformers")
    t.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    t.add_argument("--json", default=None, help="write the results to this file")
    add_engine_args(t)
    t.set_defaults(run=run_throughput)
    bench_serve.register(kinds)
    bench_latency.register(kinds)


Workload = list[tuple[list[int], int]]  # (prompt token ids, output tokens) per request


def _workload(args: argparse.Namespace, vocab_size: int, special: set[int]) -> Workload:
    """Seeded prompts; with --range-ratio r, lengths are uniform in [L(1-r), L(1+r)]."""
    rng = np.random.default_rng(0)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special, int, len(special)))
    prefix = rng.choice(allowed, args.prefix_len).tolist() if args.dataset == "prefix" else []

    def length(mean: int) -> int:
        low = max(1, round(mean * (1 - args.range_ratio)))
        return int(rng.integers(low, round(mean * (1 + args.range_ratio)) + 1))

    return [(prefix + rng.choice(allowed, length(args.input_len)).tolist(),
             length(args.output_len)) for _ in range(args.num_prompts)]


def _time_octavo(llm, work: Workload) -> Run:
    from octavo.params import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()  # every run starts cold: the same work each time
    start = time.perf_counter()
    pending = {}
    for prompt, out_len in work:
        rid = engine.next_request_id()
        engine.add_request(rid, prompt, SamplingParams(max_tokens=out_len, ignore_eos=True,
                                                       temperature=0))
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


def _time_transformers(model, work: Workload, batch_size: int) -> Run:
    """Static batches in input order, left-padded; a batch runs to its longest output and only
    the tokens each request asked for are counted."""
    import torch

    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(work), batch_size):
            chunk = work[i:i + batch_size]
            width = max(len(p) for p, _ in chunk)
            ids = torch.zeros(len(chunk), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for row, (p, _) in enumerate(chunk):
                ids[row, width - len(p):] = torch.tensor(p)
                mask[row, width - len(p):] = 1
            longest = max(n for _, n in chunk)
            model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=0)
            produced += sum(n for _, n in chunk)
    return Run(time.perf_counter() - start, produced)


def _load_transformers(llm):
    import torch
    from transformers import AutoModelForCausalLM

    from octavo.worker.worker import resolve_dtype

    source = llm.engine.source
    dtype = resolve_dtype(llm.engine.config.model.dtype, torch.device("cpu"))
    if source.is_gguf:
        model = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.path.name,
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    return model.eval()


def _kv_accounting(llm) -> dict:
    """KV slots held by finished requests but never written, and the peak concurrency."""
    s = llm.engine.client.stats()
    waste = s.kv_slots_unwritten / s.kv_slots_allocated if s.kv_slots_allocated else 0.0
    return {"kv_unwritten_fraction": round(waste, 4), "peak_running_requests": s.peak_running}


def run_throughput(args: argparse.Namespace) -> int:
    from octavo.llm import LLM

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            raise ValueError(f"--backends: unknown backend {b!r}; known: {', '.join(BACKENDS)}")
    if args.repeats < 1 or args.num_prompts < 1:
        raise ValueError("--repeats and --num-prompts must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    config = EngineConfig.from_cli(args)
    llm = LLM.from_config(config)
    prompts = _workload(args, llm.engine.arch.vocab_size, set(llm.tokenizer.all_special_ids))
    engines = {"octavo": llm}
    runners = {}
    for b in backends:
        if b == "octavo-no-prefix-cache":
            engines[b] = LLM.from_config(config.replace(enable_prefix_caching=False))
        if b.startswith("octavo"):
            runners[b] = (lambda e: lambda ps: _time_octavo(e, ps))(engines[b])
        else:
            hf = _load_transformers(llm)
            runners[b] = lambda ps: _time_transformers(hf, ps, args.hf_batch_size)
    runs: dict[str, list[Run]] = {b: [] for b in backends}
    for b in backends:  # warm-up
        runners[b](prompts[:2])
    for _ in range(args.repeats):
        for b in backends:
            runs[b].append(runners[b](prompts))
    n_prompt = sum(len(p) for p, _ in prompts)
    results = [Result(b, runs[b], len(prompts), n_prompt,
                      _kv_accounting(engines[b]) if b in engines else None) for b in backends]
    report = {"dataset": args.dataset, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len,
              "prefix_len": args.prefix_len if args.dataset == "prefix" else 0,
              "range_ratio": args.range_ratio, "prompt_tokens": n_prompt,
              "output_tokens": sum(n for _, n in prompts),
              "repeats": args.repeats,
              "runs_seconds": {b: [round(r.seconds, 3) for r in runs[b]] for b in backends},
              "results": [r.row() for r in results]}
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
        print(line + f" (median of {args.repeats})")
    base = results[0].row()
    for r in results[1:]:
        row = r.row()
        report[f"{results[0].backend}_speedup_over_{r.backend}"] = round(
            row["seconds"] / base["seconds"], 3)
        msg = f"{results[0].backend} is {row['seconds'] / base['seconds']:.2f}x the throughput " \
              f"of {r.backend}"
        if "ttft_mean_s" in row and "ttft_mean_s" in base:
            msg += f"; TTFT {row['ttft_mean_s'] / base['ttft_mean_s']:.2f}x lower"
        print(msg)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
