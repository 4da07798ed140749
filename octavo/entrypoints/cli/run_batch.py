"""`octavo run-batch -i requests.jsonl -o results.jsonl [MODEL | --url URL]`: an OpenAI batch
file run offline on an engine started here, or sent to a running server (`batch.py` has the
format)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from octavo.config import DEFAULT_MODEL, add_engine_args
from octavo.entrypoints.cli.serve import add_app_args

logger = logging.getLogger(__name__)

def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="run an OpenAI batch file (JSONL) offline or against "
                                         "a server")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help=f"the model to run (default {DEFAULT_MODEL}); same as --model")
    p.add_argument("-i", "--input-file", required=True,
                   help="the batch: one {custom_id, method, url, body} object per line")
    p.add_argument("-o", "--output-file", required=True,
                   help="the results, one line per input line in the same order (written "
                        "whole at the end)")
    p.add_argument("--url", default=None,
                   help="send the requests to the server at this address instead of running "
                        "the model here (e.g. http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None,
                   help="with --url: the server's API key (default: $OCTAVO_API_KEY)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at once (default: 2 x --max-num-seqs here, 32 "
                        "with --url)")
    add_app_args(p)
    add_engine_args(p)
    # One line per request on stderr would bury the progress bar.
    p.set_defaults(run=run, disable_access_log=True)


def run(args: argparse.Namespace) -> int:
    from octavo.entrypoints.batch import count_lines

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not os.path.isfile(args.input_file):
        raise ValueError(f"--input-file {args.input_file!r} is not a file")
    out_dir = os.path.dirname(os.path.abspath(args.output_file))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output-file: the folder {out_dir!r} does not exist")
    total = count_lines(args.input_file)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request buries the bar
    if args.url:
        _refuse_engine_flags(args)
        return asyncio.run(_remote(args, total))
    if args.model_tag:
        args.model = args.model_tag
    return _offline(args, total)


def _refuse_engine_flags(args: argparse.Namespace) -> None:
    from octavo.entrypoints.cli.args import changed_flags

    given = [d for d in changed_flags(args, add_app_args, add_engine_args)
             if d != "disable_access_log"]
    if args.model_tag:
        given.insert(0, "model")
    if given:
        raise ValueError(f"--url sends the batch to a running server, whose own settings "
                         f"apply; these flags are for running the model here: "
                         f"{', '.join('--' + d.replace('_', '-') for d in given)}")


async def _remote(args: argparse.Namespace, total: int) -> int:
    import httpx

    key = args.api_key or os.environ.get("OCTAVO_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx.AsyncClient(base_url=args.url.rstrip("/").removesuffix("/v1"),
                                 headers=headers, timeout=None) as client:
        return await _run(client, args, total, args.max_concurrency or 32)


def _offline(args: argparse.Namespace, total: int) -> int:
    from octavo.entrypoints.cli.serve import open_state
    from octavo.entrypoints.http import build_app

    state = open_state(args)
    app = build_app(state)
    concurrency = args.max_concurrency or 2 * state.engine.config.scheduler.max_num_seqs

    started = False

    async def main() -> int:
        import httpx

        nonlocal started
        died = asyncio.Event()
        state.on_engine_death = died.set
        started = True  # from here the app's shutdown stops the engine
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app, raise_app_exceptions=False,
                                            client=("run-batch", 0))
            async with httpx.AsyncClient(transport=transport, base_url="http://octavo",
                                         timeout=None) as client:
                work = asyncio.create_task(_run(client, args, total, concurrency))
                watch = asyncio.create_task(died.wait())
                await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
                if not work.done():
                    work.cancel()
                    await asyncio.gather(work, return_exceptions=True)
                    raise RuntimeError(f"the engine core died ({state.engine.dead}); no "
                                       f"output was written")
                watch.cancel()
                return work.result()

    try:
        return asyncio.run(main())
    except RuntimeError as exc:  # the engine died, or failed to start
        print(f"octavo: error: {exc}", file=sys.stderr)
        return 1
    finally:
        if not started:
            state.engine.close()


async def _run(client, args: argparse.Namespace, total: int, concurrency: int) -> int:
    from tqdm import tqdm

    from octavo.entrypoints.batch import BatchRunner, OrderedAtomicWriter

    writer = OrderedAtomicWriter(args.output_file)
    with tqdm(total=total, unit="req", desc="Running batch", file=sys.stderr,
              disable=None) as bar:
        runner = BatchRunner(client, concurrency, on_done=bar.update)
        try:
            with open(args.input_file, "rb") as lines:
                count = await runner.run(lines, writer)
            writer.commit()
        except BaseException:
            writer.discard()
            raise
    logger.info("batch done: %d requests, %d failed; results in %s", count, runner.failed,
                args.output_file)
    return 0
