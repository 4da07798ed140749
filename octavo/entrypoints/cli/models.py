"""`octavo models`: the architectures octavo can load, by Hugging Face and GGUF name."""
from __future__ import annotations

import argparse
import json

from octavo.arch_config import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES
from octavo.model.registry import supported_architectures


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the supported model architectures")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    rows = {arch: sorted([g for g, hf in GGUF_ARCHITECTURES.items() if hf == arch]
                         + [f"{g} (with experts)" for g, hf in GGUF_EXPERT_ARCHITECTURES.items()
                            if hf == arch])
            for arch in supported_architectures()}
    if args.json:
        print(json.dumps({"architectures": rows}, indent=2))
        return 0
    width = max(len("Hugging Face architecture"), *map(len, rows)) + 2
    print(f"{'Hugging Face architecture':<{width}}GGUF general.architecture")
    for arch, gguf in rows.items():
        print(f"{arch:<{width}}{', '.join(gguf) or '-'}")
    return 0
