"""Two local ranks for the micro-benchmarks: a free TCP port to meet at, one spawned process per
rank running `target(rank, init_method, *args, results)`, and rank 0's result."""
from __future__ import annotations

import multiprocessing
import socket
from collections.abc import Callable
from typing import Any


def run_two(target: Callable[..., None], *args: Any, timeout_s: float = 600) -> Any:
    """Each rank puts (rank, result) on `results`, its last argument."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, init, *args, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout_s) for _ in procs)
    for p in procs:
        p.join()
    return got[0]
