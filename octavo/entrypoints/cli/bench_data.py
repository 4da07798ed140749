"""Bench workloads: seeded lists of (prompt token ids, output tokens).

- `random`: token ids drawn uniformly from the non-special vocabulary; with `--range-ratio r`
  the input and output lengths are uniform in [L(1-r), L(1+r)].
- `prefix`: one shared `--prefix-len` prompt followed by a distinct random suffix per request.
- `sharegpt`: conversations from a local JSON file in the ShareGPT format (a list of
  `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`):
  the first human turn is the prompt and the length of the reply that follows it, in tokens, is
  the output length. Conversations are shuffled with the seed; pairs with a prompt or reply under
  4 tokens, or longer together than `max_len`, are skipped.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

Workload = list[tuple[list[int], int]]
DATASETS = ("random", "prefix", "sharegpt")


def add_dataset_args(p: argparse.ArgumentParser, input_len: int, output_len: int) -> None:
    p.add_argument("--dataset", choices=DATASETS, default="random")
    p.add_argument("--dataset-path", default=None, help="the JSON file of --dataset sharegpt")
    p.add_argument("--input-len", type=int, default=input_len,
                   help="prompt tokens (with --dataset prefix: the distinct suffix)")
    p.add_argument("--output-len", type=int, default=output_len)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix of --dataset prefix")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="input and output lengths uniform in [L(1-r), L(1+r)] (seeded)")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the workload")


def build_workload(args: argparse.Namespace, vocab_size: int, special: set[int],
                   tokenizer=None, max_len: int | None = None) -> Workload:
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError(f"--range-ratio must be in [0, 1), got {args.range_ratio}")
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    rng = np.random.default_rng(args.dataset_seed)
    if args.dataset == "sharegpt":
        return _sharegpt(args, tokenizer, rng, max_len)
    allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special, int, len(special)))
    prefix = rng.choice(allowed, args.prefix_len).tolist() if args.dataset == "prefix" else []

    def length(mean: int) -> int:
        low = max(1, round(mean * (1 - args.range_ratio)))
        return int(rng.integers(low, round(mean * (1 + args.range_ratio)) + 1))

    return [(prefix + rng.choice(allowed, length(args.input_len)).tolist(),
             length(args.output_len)) for _ in range(args.num_prompts)]


def _sharegpt(args: argparse.Namespace, tokenizer, rng: np.random.Generator,
              max_len: int | None) -> Workload:
    if not args.dataset_path:
        raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
    path = Path(args.dataset_path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--dataset-path: cannot read {path}: {exc}") from None
    if not isinstance(data, list):
        raise ValueError(f"--dataset-path: {path} must hold a JSON list of conversations")
    pairs = []
    for item in data:
        turns = item.get("conversations") if isinstance(item, dict) else None
        if isinstance(turns, list) and len(turns) >= 2 and all(
                isinstance(t, dict) and isinstance(t.get("value"), str) for t in turns[:2]):
            pairs.append((turns[0]["value"], turns[1]["value"]))
    work: Workload = []
    for i in rng.permutation(len(pairs)):
        prompt = tokenizer.encode(pairs[i][0], add_special_tokens=False)
        reply_len = len(tokenizer.encode(pairs[i][1], add_special_tokens=False))
        if len(prompt) < 4 or reply_len < 4:
            continue
        if max_len is not None and len(prompt) + reply_len > max_len:
            continue
        work.append((prompt, reply_len))
        if len(work) == args.num_prompts:
            return work
    raise ValueError(f"--dataset-path: {path} has only {len(work)} usable conversations, "
                     f"--num-prompts asks for {args.num_prompts}")
