"""`octavo pull NAME`: fetch a catalog model ahead of time."""
from __future__ import annotations

import argparse

from octavo.model_source import CATALOG, pull


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="fetch a catalog model into the cache")
    p.add_argument("name", choices=sorted(CATALOG))
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(pull(args.name))
    return 0
