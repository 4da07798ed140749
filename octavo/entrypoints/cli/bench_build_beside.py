"""`octavo bench build-beside`: decode speed while the C++ kernels build beside the engine, as a
ratio to the speed with nothing beside it, measured side by side in one run.

A build (into a scratch cache, so it really compiles) starts at the priority a serving engine
gives it (`--build-priority idle`: SCHED_IDLE, nice 19) or at the user's own priority
(`normal`: what a compiler started by hand, or by the engine before, does to decode); each round
times one quiet request and one while the compiler runs, then stops the build.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np

from octavo.config import EngineConfig, add_engine_args
from octavo.entrypoints.cli.bench_latency import _octavo_once

PRIORITIES = ("idle", "normal")


def register(kinds: argparse._SubParsersAction) -> None:
    t = kinds.add_parser("build-beside", help="decode speed while the kernels build beside it")
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--input-len", type=int, default=32)
    t.add_argument("--repeats", type=int, default=3, help="rounds (median of each kind)")
    t.add_argument("--build-priority", default="idle,normal",
                   help=f"comma-separated: {', '.join(PRIORITIES)}")
    t.add_argument("--settle", type=float, default=4.0,
                   help="seconds between starting the build and timing (the child imports "
                        "torch first; the compiler runs after)")
    t.add_argument("--json", default=None)
    add_engine_args(t)
    t.set_defaults(run=run)


def _decode_rate(llm, prompt: list[int], output_len: int) -> float:
    start, stamps = _octavo_once(llm, prompt, output_len)
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def _beside_build(llm, prompt: list[int], output_len: int, priority: str,
                  settle: float) -> float:
    from octavo.kernels import build

    scratch = tempfile.mkdtemp(prefix="octavo-build-beside-")
    child = build.spawn(beside_engine=priority == "idle", cache=scratch)
    try:
        time.sleep(settle)
        if child.poll() is not None:
            raise ValueError(f"the kernel build ended (status {child.returncode}) before it "
                             f"could be timed: raise --output-len or lower --settle")
        rate = _decode_rate(llm, prompt, output_len)
        if child.poll() is not None:
            print("  (the build finished during the timed request: the ratio is flattered)")
        return rate
    finally:
        build.stop(child)
        shutil.rmtree(scratch, ignore_errors=True)


def run(args: argparse.Namespace) -> int:
    from octavo.llm import LLM

    priorities = [p.strip() for p in args.build_priority.split(",") if p.strip()]
    if not priorities or any(p not in PRIORITIES for p in priorities):
        raise ValueError(f"--build-priority: choose from {', '.join(PRIORITIES)}")
    if args.repeats < 1 or args.output_len < 2:
        raise ValueError("--repeats must be >= 1 and --output-len >= 2")
    llm = LLM.from_config(EngineConfig.from_cli(args))
    rng = np.random.default_rng(0)
    special = set(llm.tokenizer.all_special_ids)
    allowed = [t for t in range(llm.engine.arch.vocab_size) if t not in special]
    prompt = rng.choice(allowed, args.input_len).tolist()
    _decode_rate(llm, prompt, args.output_len)  # warm-up
    rates: dict[str, list[float]] = {"quiet": [], **{p: [] for p in priorities}}
    for _ in range(args.repeats):
        rates["quiet"].append(_decode_rate(llm, prompt, args.output_len))
        for p in priorities:
            rates[p].append(_beside_build(llm, prompt, args.output_len, p, args.settle))
    quiet = statistics.median(rates["quiet"])
    report = {"output_len": args.output_len, "repeats": args.repeats,
              "decode_tokens_per_s": {k: round(statistics.median(v), 2) for k, v in rates.items()},
              "ratio_to_quiet": {p: round(statistics.median(rates[p]) / quiet, 3)
                                 for p in priorities}}
    print(f"decode, nothing beside: {quiet:.1f} tokens/s")
    for p in priorities:
        print(f"decode, {p}-priority build beside: {statistics.median(rates[p]):.1f} tokens/s "
              f"({report['ratio_to_quiet'][p]:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0
