"""`octavo models`: the architectures octavo can load, by Hugging Face and GGUF name: those of
its native files, and with --transformers those the transformers backend runs."""
from __future__ import annotations

import argparse
import json

from octavo.gguf_arch_config import GGUF_ARCHITECTURES, GGUF_EXPERT_ARCHITECTURES
from octavo.model.registry import supported_architectures


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("models", help="list the supported model architectures")
    p.add_argument("--json", action="store_true", help="print a JSON object instead of a table")
    p.add_argument("--transformers", action="store_true",
                   help="also list the architectures without a native file that the "
                        "transformers backend runs (imports transformers: seconds)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    rows = {arch: sorted([g for g, hf in GGUF_ARCHITECTURES.items() if hf == arch]
                         + [f"{g} (with experts)" for g, hf in GGUF_EXPERT_ARCHITECTURES.items()
                            if hf == arch])
            for arch in supported_architectures()}
    backend = None
    if args.transformers:
        from octavo.model.registry import backend_architectures

        backend = backend_architectures()
    if args.json:
        print(json.dumps({"architectures": rows, "transformers_backend": backend}, indent=2))
        return 0
    width = max(len("Hugging Face architecture"), *map(len, rows)) + 2
    print(f"{'Hugging Face architecture':<{width}}GGUF general.architecture")
    for arch, gguf in rows.items():
        print(f"{arch:<{width}}{', '.join(gguf) or '-'}")
    if backend is None:
        print("\nAny other decoder-only architecture of transformers whose code takes an external "
              "attention function runs through the transformers backend (--model-impl auto); "
              "`octavo models --transformers` lists them.")
    else:
        print(f"\nThrough the transformers backend ({len(backend)}): {', '.join(backend)}")
    return 0
