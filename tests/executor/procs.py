"""Which processes a test left: its live children, and whether a pid is still running."""
from __future__ import annotations

import os
import time
from pathlib import Path


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of `pid`, None when it is gone."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after "(comm)": state, ppid, ...
    return fields[0], int(fields[1])


def children(parent: int | None = None) -> set[int]:
    """Pids of `parent`'s (default: this process's) live (not zombie) children, but for
    multiprocessing's resource tracker: an earlier test's use of multiprocessing starts it, and
    it stays for the life of the process by design."""
    parent = os.getpid() if parent is None else parent
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None and stat[1] == parent and stat[0] != "Z" \
                    and not _is_resource_tracker(int(entry.name)):
                pids.add(int(entry.name))
    return pids


def _is_resource_tracker(pid: int) -> bool:
    try:
        cmdline = (Path("/proc") / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return b"multiprocessing.resource_tracker" in cmdline


def descendants(parent: int | None = None) -> set[int]:
    """Pids of every live process below `parent` (default: this process)."""
    found, todo = set(), [os.getpid() if parent is None else parent]
    while todo:
        below = children(todo.pop())
        found |= below
        todo.extend(below)
    return found


def alive(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] != "Z"


def gone(pids, bound_s: float) -> bool:
    """Whether every pid in `pids` has exited within `bound_s` seconds."""
    deadline = time.monotonic() + bound_s
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
