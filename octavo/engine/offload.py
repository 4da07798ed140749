"""The front end's CPU work off the event loop: tokenization, chat-template rendering and grammar
checks run in a small thread pool, each within a time budget, so that a megabyte prompt or a
slow template never freezes the other streams or /health.

A thread cannot be stopped from outside, so the budget is kept twice: the caller stops waiting
when it runs out (the request gets a 400 at once), and the work itself is bounded where it can
loop (a template render checks the same deadline on every line; tokenizing is linear in a body
that the request-size limit bounds; grammars are capped in size and depth before they parse).
"""
from __future__ import annotations

import asyncio
import concurrent.futures as cf
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

# Two threads: the tokenizer releases the GIL while it encodes, so a long prompt and a short
# one tokenize side by side on the two cores the front end shares with the engine.
WORKERS = 2


class PreprocessTimeout(ValueError):
    """Preparing a request took longer than its budget; the request is refused (400)."""


class Offload:
    def __init__(self, timeout_s: float, workers: int = WORKERS) -> None:
        if not timeout_s > 0:
            raise ValueError(f"preprocess_timeout must be > 0 seconds, got {timeout_s!r}")
        self.timeout_s = timeout_s
        self._pool = cf.ThreadPoolExecutor(workers, thread_name_prefix="octavo-preprocess")

    async def run(self, what: str, fn: Callable[..., T], *args) -> T:
        """`fn(*args)` in the pool; PreprocessTimeout naming `what` past the budget."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except (asyncio.TimeoutError, TimeoutError):
            raise PreprocessTimeout(f"{what} took longer than {self.timeout_s:g} s (the "
                                    f"server's --preprocess-timeout)") from None

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
