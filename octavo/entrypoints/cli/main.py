"""The `octavo` command."""
from __future__ import annotations

import argparse
import logging
import sys

from octavo.entrypoints.cli import bench, generate, models, pull, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="octavo", description="LLM inference engine")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in (serve, generate, pull, bench, models):
        module.register(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.run(args) or 0
    except (ValueError, NotImplementedError) as exc:
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
