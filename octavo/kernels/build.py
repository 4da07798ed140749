"""Building the C++ kernels in a process of their own.

Three callers: `pip install` (setup.py runs this module with the installing environment's
torch), `octavo build-kernels`, and a serving engine that found no build. Beside an engine the
build must not take its cores: on two cores a compiler at normal priority preempts the engine's
OpenMP threads, whose barriers then wait on the preempted one (decode falls to a few tokens a
second). So that child runs at idle priority (SCHED_IDLE, nice 19: the compiler gets only the
cycles the engine leaves), and dies with the engine. Its two translation units compile side by
side as in any build: at idle priority a second compiler costs the engine no more than one
(SmolLM2 batch-1 decode beside either: within the run-to-run noise of the same decode alone).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys

from octavo.lifetime import die_with_parent


def _lower_priority() -> None:
    os.nice(19)  # what inherits no SCHED_IDLE (another OS) still yields to the engine
    if hasattr(os, "sched_setscheduler"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError:
            pass


def spawn(beside_engine: bool, cache: str | None = None) -> subprocess.Popen:
    """A child building the kernels (into `cache`, default $OCTAVO_CACHE); `beside_engine`:
    idle priority, dead with the thread that called this."""
    env = dict(os.environ)
    if cache is not None:
        env["OCTAVO_CACHE"] = cache
    flags = ["--beside-engine", str(os.getpid())] if beside_engine else []
    # A process group of its own, with ninja and the compiler in it: `stop` ends them all. Not
    # a session of its own: with autogroup scheduling a new session is a new task group that
    # gets a full share beside the engine's, whatever its priority inside (measured: decode
    # at 0.01x with an idle-priority build in a new session).
    return subprocess.Popen([sys.executable, "-m", "octavo.kernels.build", *flags], env=env,
                            stdin=subprocess.DEVNULL, process_group=0)


def stop(proc: subprocess.Popen) -> None:
    """End a spawned build, compiler included."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_beside_engine() -> int:
    """Build in a child at idle priority and wait for it; its exit status (0: built)."""
    proc = spawn(beside_engine=True)
    try:
        return proc.wait()
    finally:
        stop(proc)  # a no-op unless this thread was interrupted


def _end_group(signum, frame) -> None:
    os.killpg(0, signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m octavo.kernels.build",
                                     description="build octavo's C++ CPU kernels for this machine")
    parser.add_argument("--beside-engine", type=int, metavar="PARENT_PID",
                        help="idle priority, die with this parent process")
    args = parser.parse_args(argv)
    if args.beside_engine is not None:
        # The parent's death signals this process, which takes its compiler down with it (a
        # SIGKILL here would leave ninja and g++ running as orphans).
        signal.signal(signal.SIGTERM, _end_group)
        die_with_parent(signal.SIGTERM)
        if os.getppid() != args.beside_engine:  # it died before the signal was armed
            return 1
        _lower_priority()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from octavo.kernels import native

    return 0 if native.build() is not None else 1


if __name__ == "__main__":
    sys.exit(main())
