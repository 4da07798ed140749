"""`octavo bench embed`: embedding throughput of an engine of task embed, and beside it
sentence-transformers' `encode` on the same folder, texts and threads (`--backends
octavo,sentence-transformers`), the runs alternated, medians reported, with the ratio.

The texts are made of single-token words of the model's vocabulary, each text between
--min-len and --max-len tokens with its special tokens (seeded), so that both backends see the
same token counts.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

BACKENDS = ("octavo", "sentence-transformers")


def register(kinds: argparse._SubParsersAction) -> None:
    e = kinds.add_parser("embed", help="embedding throughput (task embed)")
    e.add_argument("--model", default="all-minilm-l6-v2")
    e.add_argument("--backends", default="octavo",
                   help=f"comma-separated: {', '.join(BACKENDS)}")
    e.add_argument("--num-prompts", type=int, default=256, help="texts per run (one batch)")
    e.add_argument("--min-len", type=int, default=32, help="fewest tokens of a text")
    e.add_argument("--max-len", type=int, default=128, help="most tokens of a text")
    e.add_argument("--repeats", type=int, default=3, help="timed runs per backend (median)")
    e.add_argument("--dtype", default="auto", help="octavo's --dtype")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--json", default=None, help="write the results here")
    e.set_defaults(run=run)


def _texts(tokenizer, count: int, low: int, high: int, seed: int) -> list[str]:
    """`count` texts of single-token words, each low..high tokens long with specials."""
    rng = random.Random(seed)
    words = sorted(w for w, _ in tokenizer.get_vocab().items()
                   if w.isalpha() and w.islower() and len(w) > 2
                   and len(tokenizer.encode(w, False)) == 1)
    special = len(tokenizer.encode("a")) - len(tokenizer.encode("a", False))
    return [" ".join(rng.choice(words) for _ in range(rng.randint(low, high) - special))
            for _ in range(count)]


def run(args: argparse.Namespace) -> None:
    from octavo import LLM
    from octavo.model_source import resolve_model

    backends = args.backends.split(",")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(f"--backends: unknown {sorted(unknown)}; known: {', '.join(BACKENDS)}")
    llm = LLM(args.model, dtype=args.dtype, task="embed")
    texts = _texts(llm.get_tokenizer(), args.num_prompts, args.min_len, args.max_len, args.seed)
    tokens = sum(len(llm.get_tokenizer().encode(t)) for t in texts)
    runners = {"octavo": lambda: llm.embed(texts, use_tqdm=False)}
    if "sentence-transformers" in backends:
        from sentence_transformers import SentenceTransformer

        folder = resolve_model(args.model).path
        st = SentenceTransformer(str(folder), device="cpu")
        st.max_seq_length = max(st.max_seq_length, args.max_len)
        runners["sentence-transformers"] = lambda: st.encode(texts, batch_size=len(texts),
                                                             show_progress_bar=False)
    for name in backends:  # a warm-up each: first-call allocations, lazy set-up
        runners[name]()
    times: dict[str, list[float]] = {name: [] for name in backends}
    for _ in range(args.repeats):
        for name in backends:
            start = time.perf_counter()
            runners[name]()
            times[name].append(time.perf_counter() - start)
    llm.engine.shutdown()
    results = {}
    for name in backends:
        median = statistics.median(times[name])
        results[name] = {"seconds": times[name], "median_s": median,
                         "texts_per_s": len(texts) / median, "tokens_per_s": tokens / median}
        print(f"{name:>22}: {len(texts) / median:8.1f} texts/s, {tokens / median:9.0f} "
              f"tokens/s (median of {args.repeats}: {median * 1000:.1f} ms)")
    if len(backends) > 1:
        a, b = (results[n]["texts_per_s"] for n in backends[:2])
        print(f"{backends[0]} / {backends[1]}: {a / b:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"texts": len(texts), "tokens": tokens, "results": results}, f, indent=1)
