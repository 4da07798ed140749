"""Command-line flags for SamplingParams, derived from its fields; which flags a command line
changed."""
from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any

from octavo.params import SamplingParams

_LISTS = {"stop": str, "stop_token_ids": int}
_SKIP = {"logit_bias", "stop_strings", "prompt_logprobs", "seed"}  # --seed is the engine seed


def add_sampling_args(parser: argparse.ArgumentParser, **defaults) -> None:
    group = parser.add_argument_group("sampling")
    for f in fields(SamplingParams):
        if f.name in _SKIP or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = defaults.get(f.name, f.default if f.default is not MISSING else None)
        if f.name in _LISTS:
            group.add_argument(flag, type=_LISTS[f.name], action="append", default=None,
                               help=f"{f.name} (repeat the flag for several)")
        elif isinstance(f.default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        else:
            kind = float if isinstance(f.default, float) else int
            group.add_argument(flag, type=kind, default=default)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    values = {f.name: getattr(args, f.name) for f in fields(SamplingParams)
              if f.init and f.name not in _SKIP and hasattr(args, f.name)}
    return SamplingParams(**values)


def changed_flags(args: argparse.Namespace,
                  *adders: Callable[[argparse.ArgumentParser], None]) -> dict[str, Any]:
    """The flags that `adders` define whose value in `args` is not their default."""
    parser = argparse.ArgumentParser(add_help=False)
    for add in adders:
        add(parser)
    defaults = vars(parser.parse_args([]))
    return {dest: getattr(args, dest) for dest, default in defaults.items()
            if hasattr(args, dest) and getattr(args, dest) != default}
