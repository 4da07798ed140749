"""Measurement (not a test): the share of a batch-1 decode step spent outside the model's own
compute (its forward, the logits and the sampler), the per-step Python overhead issue 28 bounds.

    python3 tools/step_overhead.py [catalog model=smollm2-135m-instruct] [tokens=129] [runs=3]

Each run generates `tokens` greedy tokens for one short prompt through `LLM.generate`, timing
those three calls inside it; the rest of the wall time is the engine's own per-step work.
"""
from __future__ import annotations

import statistics
import sys
import time


def _timed(totals: dict[str, float], key: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - start
    return wrapper


def main() -> None:
    from octavo import LLM, SamplingParams
    from octavo.model_source import pull

    name = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct"
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 129
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    llm = LLM(str(pull(name)), max_model_len=tokens + 64, kv_cache_memory=64 << 20)
    runner = llm.engine.client.core.executor.worker.runner
    totals = {"forward": 0.0, "logits": 0.0, "sampler": 0.0}
    runner.model.forward = _timed(totals, "forward", runner.model.forward)
    runner.model.compute_logits = _timed(totals, "logits", runner.model.compute_logits)
    sampler = runner.sampler
    runner.sampler = _timed(totals, "sampler", sampler)
    prompt = llm.tokenizer.encode("The history of the lighthouse is")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], params, use_tqdm=False)  # warm-up
    shares = []
    for _ in range(runs):
        totals.update(dict.fromkeys(totals, 0.0))
        start = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.perf_counter() - start
        n = len(out.outputs[0].token_ids)
        outside = wall - sum(totals.values())
        shares.append(outside / wall)
        print(f"{name}: {wall / n * 1e3:.2f} ms/token; forward {totals['forward'] / n * 1e3:.2f}, "
              f"logits {totals['logits'] / n * 1e3:.2f}, sampler "
              f"{totals['sampler'] / n * 1e3:.2f}, outside {outside / n * 1e3:.2f} ms "
              f"({100 * outside / wall:.1f}%)")
    print(f"median share outside the model's compute: {100 * statistics.median(shares):.1f}%")
    llm.engine.shutdown()


if __name__ == "__main__":
    main()
