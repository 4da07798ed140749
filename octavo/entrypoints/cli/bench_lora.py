"""`octavo bench lora`: what LoRA adapters cost, side by side in one engine.

Random PEFT-format adapters (rank `--lora-rank` on every q/k/v/o and gate/up/down projection,
written from the model's shapes, no peft needed) are served from one engine with
`--max-loras` slots. Three timings, interleaved over `--repeats` runs, medians reported:
- `base`: `--num-prompts` requests on the base model, one batch;
- `lora`: the same requests spread round-robin over `--num-adapters` adapters, one batch;
- `merged`: each adapter's share of the requests as its own batch on the base model, one after
  another: what serving a merged copy of the model per adapter costs in compute alone; and
  `merged+loads`, the same with one engine start per copy (a merged copy is the base model's
  size: its start is timed once on the base model, caches warm), which a machine that cannot
  hold every copy at once pays.
Then batch-1 decode (one request, `--output-len` tokens) with and without an adapter.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from octavo.config import EngineConfig, add_engine_args

_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def register(kinds: argparse._SubParsersAction) -> None:
    t = kinds.add_parser("lora", help="LoRA adapters' cost against the base model")
    t.add_argument("--num-prompts", type=int, default=32)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--num-adapters", type=int, default=8)
    t.add_argument("--lora-rank", type=int, default=16)
    t.add_argument("--repeats", type=int, default=3, help="timed runs; medians are reported")
    t.add_argument("--adapter-dir", default=None,
                   help="where the random adapters are written (default: a temporary folder)")
    t.add_argument("--json", default=None, help="write the results to this file")
    add_engine_args(t)
    t.set_defaults(run=run, enable_lora=True, max_loras=8, max_lora_rank=16)


def write_adapter(folder: Path, arch, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of `rank` on every projection of every layer, A and B drawn at
    random with about the spread trained adapters have."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {"self_attn.q_proj": (q, arch.hidden_size),
              "self_attn.k_proj": (kv, arch.hidden_size),
              "self_attn.v_proj": (kv, arch.hidden_size),
              "self_attn.o_proj": (arch.hidden_size, q),
              "mlp.gate_proj": (arch.intermediate_size, arch.hidden_size),
              "mlp.up_proj": (arch.intermediate_size, arch.hidden_size),
              "mlp.down_proj": (arch.hidden_size, arch.intermediate_size)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for module, (out, inp) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=gen) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=gen) * 0.01
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(_TARGETS), "bias": "none"}))


def _batch(llm, prompts, loras, output_len: int) -> float:
    from octavo.params import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - start


def _decode_tokens_per_s(llm, prompt, lora, output_len: int) -> float:
    """Tokens per second between the first token and the last of one request."""
    from octavo.params import SamplingParams

    engine = llm.engine
    llm.reset_prefix_cache()
    rid = engine.next_request_id()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=output_len, ignore_eos=True,
                                                   temperature=0), lora_request=lora)
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step(delta=True):
            stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def run(args: argparse.Namespace) -> int:
    from octavo.llm import LLM
    from octavo.params import LoRARequest

    if args.num_adapters < 1 or args.num_prompts < args.num_adapters:
        raise ValueError("--num-adapters must be >= 1 and at most --num-prompts")
    config = EngineConfig.from_cli(args)
    if args.lora_rank > config.lora.max_lora_rank or args.num_adapters > config.lora.max_loras:
        raise ValueError("--lora-rank and --num-adapters must fit --max-lora-rank and "
                         "--max-loras")
    llm = LLM.from_config(config)
    arch = llm.engine.arch
    folder = Path(args.adapter_dir or tempfile.mkdtemp(prefix="octavo-bench-lora-"))
    loras = []
    for i in range(args.num_adapters):
        write_adapter(folder / f"adapter{i}", arch, args.lora_rank, seed=i)
        loras.append(LoRARequest(f"adapter{i}", i + 1, str(folder / f"adapter{i}")))
    rng = np.random.default_rng(0)
    special = set(llm.tokenizer.all_special_ids)
    allowed = [t for t in range(arch.vocab_size) if t not in special]
    prompts = [rng.choice(allowed, args.input_len).tolist() for _ in range(args.num_prompts)]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    shares = [[p for j, p in enumerate(prompts) if j % len(loras) == i]
              for i in range(len(loras))]
    n, out = args.num_prompts, args.output_len
    runners = {
        "base": lambda: _batch(llm, prompts, None, out),
        "lora": lambda: _batch(llm, prompts, spread, out),
        "merged": lambda: sum(_batch(llm, share, None, out) for share in shares),
        "decode_base": lambda: _decode_tokens_per_s(llm, prompts[0], None, out),
        "decode_lora": lambda: _decode_tokens_per_s(llm, prompts[0], loras[0], out),
    }
    for fn in runners.values():
        fn()  # warm-up: every adapter loaded once, kernels built
    samples: dict[str, list[float]] = {k: [] for k in runners}
    for _ in range(args.repeats):
        for name, fn in runners.items():
            samples[name].append(fn())
    med = {k: statistics.median(v) for k, v in samples.items()}
    start = time.perf_counter()  # one more engine on the base model: a merged copy's start
    LLM.from_config(config.replace(enable_lora=False)).engine.shutdown()
    med["merged+loads"] = med["merged"] + len(loras) * (time.perf_counter() - start)
    tokens = n * (args.input_len + out)
    tput = {k: tokens / med[k] for k in ("base", "lora", "merged", "merged+loads")}
    report = {"num_prompts": n, "input_len": args.input_len, "output_len": out,
              "num_adapters": len(loras), "rank": args.lora_rank, "repeats": args.repeats,
              "total_tokens_per_s": {k: round(v, 1) for k, v in tput.items()},
              "lora_over_base": round(tput["lora"] / tput["base"], 3),
              "lora_over_merged": round(tput["lora"] / tput["merged"], 3),
              "lora_over_merged_with_loads": round(tput["lora"] / tput["merged+loads"], 3),
              "decode_tokens_per_s": {"base": round(med["decode_base"], 2),
                                      "lora": round(med["decode_lora"], 2)},
              "decode_lora_over_base": round(med["decode_lora"] / med["decode_base"], 3),
              "samples": samples}
    for k in ("base", "lora", "merged", "merged+loads"):
        print(f"{k:>12}: {tput[k]:8.1f} total tokens/s (median of {args.repeats})")
    print(f"lora / base {report['lora_over_base']:.2f}x, lora / merged one after another "
          f"{report['lora_over_merged']:.2f}x (with their starts "
          f"{report['lora_over_merged_with_loads']:.2f}x)")
    print(f"batch-1 decode: base {med['decode_base']:.1f} tokens/s, with an adapter "
          f"{med['decode_lora']:.1f} ({report['decode_lora_over_base']:.2f}x)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0
