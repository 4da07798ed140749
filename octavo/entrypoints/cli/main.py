"""The `octavo` command."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

# Subcommand -> the module that registers it.
COMMANDS = {"serve": "serve", "generate": "generate", "chat": "generate", "pull": "pull",
            "bench": "bench", "models": "models", "run-batch": "run_batch",
            "complete": "client", "collect-env": "collect_env", "build-kernels": "build_kernels"}


def _chosen_command(argv: list[str]) -> str | None:
    """The module of the subcommand named in argv, if any: only it is imported (the others pull in
    numpy, jinja2 and the bench tools: 0.2 s of every start, and again in the core process,
    which imports this module as the spawn's main)."""
    args = iter(argv)
    for arg in args:
        if arg == "--log-level":
            next(args, None)
        elif not arg.startswith("-"):
            return COMMANDS.get(arg)
    return None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="octavo", description="LLM inference engine")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen_command(argv)
    for name in dict.fromkeys(COMMANDS.values()) if chosen is None else (chosen,):
        importlib.import_module(f"octavo.entrypoints.cli.{name}").register(sub)
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
