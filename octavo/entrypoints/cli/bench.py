"""`octavo bench throughput`: offline throughput of octavo, optionally beside transformers.

Each backend runs the same prompts (random token ids, or a fixed-length synthetic dataset) for
`--repeats` timed runs after one warm-up; the median is reported, and with several backends the
ratio to the first one.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass

import numpy as np

from octavo.config import EngineConfig, add_engine_args
from octavo.entrypoints.cli import bench_serve


@dataclass
class Result:
    backend: str
    seconds: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int

    def row(self) -> dict:
        return {"backend": self.backend, "seconds": round(self.seconds, 3),
                "requests_per_s": round(self.num_requests / self.seconds, 3),
                "output_tokens_per_s": round(self.output_tokens / self.seconds, 2),
                "total_tokens_per_s": round((self.prompt_tokens + self.output_tokens)
                                            / self.seconds, 2)}


def register(sub: argparse._SubParsersAction) -> None:
    b = sub.add_parser("bench", help="benchmarks")
    kinds = b.add_subparsers(dest="kind", required=True)
    t = kinds.add_parser("throughput", help="offline throughput")
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", type=int, default=256)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--dataset", choices=["random"], default="random",
                   help="random: token ids drawn uniformly (seeded), fixed lengths")
    t.add_argument("--backends", default="octavo",
                   help="comma-separated: octavo, transformers (run side by side, same prompts)")
    t.add_argument("--hf-batch-size", type=int, default=16, help="batch size of transformers")
    t.add_argument("--repeats", type=int, default=3, help="timed runs; the median is reported")
    t.add_argument("--json", default=None, help="write the results to this file")
    add_engine_args(t)
    t.set_defaults(run=run_throughput)
    bench_serve.register(kinds)


def _prompts(args: argparse.Namespace, vocab_size: int, special: set[int]) -> list[list[int]]:
    rng = np.random.default_rng(0)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special, int, len(special)))
    return [rng.choice(allowed, args.input_len).tolist() for _ in range(args.num_prompts)]


def _time_octavo(llm, prompts, output_len: int) -> tuple[float, int]:
    from octavo.params import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outs)


def _time_transformers(model, prompts, output_len: int, batch_size: int) -> tuple[float, int]:
    import torch

    produced = 0
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch_size):
            batch = torch.tensor(prompts[i:i + batch_size])  # equal lengths: no padding
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=0)
            produced += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    return time.perf_counter() - start, produced


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
    return model.eval().to(torch.device("cpu"))


def run_throughput(args: argparse.Namespace) -> int:
    from octavo.llm import LLM

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("octavo", "transformers"):
            raise ValueError(f"--backends: unknown backend {b!r}")
    if args.repeats < 1 or args.num_prompts < 1:
        raise ValueError("--repeats and --num-prompts must be >= 1")
    llm = LLM.from_config(EngineConfig.from_cli(args))
    tok = llm.tokenizer
    prompts = _prompts(args, llm.engine.arch.vocab_size, set(tok.all_special_ids))
    runners = {}
    if "octavo" in backends:
        runners["octavo"] = lambda ps: _time_octavo(llm, ps, args.output_len)
    if "transformers" in backends:
        hf = _load_transformers(llm)
        runners["transformers"] = lambda ps: _time_transformers(hf, ps, args.output_len,
                                                                args.hf_batch_size)
    timings: dict[str, list[float]] = {b: [] for b in backends}
    produced: dict[str, int] = {}
    for b in backends:  # warm-up
        runners[b](prompts[:2])
    for _ in range(args.repeats):  # interleaved, so drift hits every backend alike
        for b in backends:
            seconds, produced[b] = runners[b](prompts)
            timings[b].append(seconds)
    results = [Result(b, statistics.median(timings[b]), len(prompts),
                      args.input_len * len(prompts), produced[b]) for b in backends]
    report = {"num_prompts": args.num_prompts, "input_len": args.input_len,
              "output_len": args.output_len, "repeats": args.repeats,
              "runs_seconds": timings, "results": [r.row() for r in results]}
    for r in results:
        row = r.row()
        print(f"{r.backend:>12}: {row['requests_per_s']:.2f} requests/s, "
              f"{row['output_tokens_per_s']:.1f} output tokens/s, "
              f"{row['total_tokens_per_s']:.1f} total tokens/s (median of {args.repeats})")
    if len(results) > 1:
        base = results[0]
        for r in results[1:]:
            ratio = r.seconds / base.seconds
            report[f"{base.backend}_speedup_over_{r.backend}"] = round(ratio, 3)
            print(f"{base.backend} is {ratio:.2f}x the throughput of {r.backend}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
