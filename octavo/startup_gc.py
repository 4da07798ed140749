"""Python's cyclic garbage collector during a start, and after it.

`import torch` makes about 170,000 objects, and a loaded model tens of thousands more. The
collector walks every tracked object on each full pass, and its thresholds trigger such passes
as the count grows: on this project's 2-core machine they took 0.15-0.4 s of a 1.1-1.4 s
`import torch` and 0.1 s of loading a model (one full pass over a started core: 0.18 s). A start
makes little cyclic garbage (about 7,000 objects, under 2 MB, for a whole core), so the collector
is paused through it. A long-running process then freezes what its start made (`gc.freeze`: the
collector never walks those objects again) and resumes collecting what it makes from then on.
"""
from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def pause() -> None:
    """Stop automatic collection until `settle` (a process that will fork: its child inherits
    the pause)."""
    gc.disable()


def settle() -> None:
    """A long-running process has started: freeze every object made so far and collect again."""
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside; the caller's setting is restored after (a library
    process's own collector policy is not ours to keep changed)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
