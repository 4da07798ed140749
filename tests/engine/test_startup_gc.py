"""The garbage collector is paused through a start and back on after it (octavo/startup_gc.py)."""
from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from octavo import startup_gc


def _run(code: str) -> str:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_paused_collector_gets_the_callers_setting_back():
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with startup_gc.collector_paused():
            assert not gc.isenabled()
            raise RuntimeError("a start that fails")
    assert gc.isenabled()
    gc.disable()
    try:
        with startup_gc.collector_paused():
            pass
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


def test_serve_turns_the_collector_back_on_when_it_refuses_a_flag():
    """`main()` may run inside a caller's process: a refused start must not leave it paused."""
    from octavo.entrypoints.cli.main import main

    assert main(["serve", "--max-queued-requests", "0"]) == 2
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_the_core_process_loads_paused_and_serves_with_its_start_frozen():
    """run_engine_core around a stand-in core: the load runs with the collector off; the loop
    runs with it on and the start's objects frozen."""
    code = """
import gc, multiprocessing as mp
from octavo.config import EngineConfig
from octavo.engine import core_process as cp

seen = {}
class Core:
    num_blocks, max_model_len = 1, 64
    def describe(self): return "stand-in"
def create(*args, **kwargs):
    seen["loading"] = gc.isenabled()
    return Core()
class Loop:
    def __init__(self, *args): pass
    def run(self): seen["serving"] = (gc.isenabled(), gc.get_freeze_count() > 1000)
    def close(self): pass
cp.create_engine_core, cp.EngineCoreProcess = create, Loop
setup, setup_child = mp.Pipe()
ready, ready_child = mp.Pipe()
setup.send((None, None, 64, []))
cp.run_engine_core(EngineConfig(), setup_child, "", "", ready_child, 30)
print(ready.recv()[0], seen["loading"], *seen["serving"])
"""
    assert _run(code).split() == ["ready", "False", "True", "True"]


def test_settle_freezes_the_start_and_collects_again():
    code = ("import gc; from octavo import startup_gc; startup_gc.pause(); "
            "junk = [[] for _ in range(5000)]; startup_gc.settle(); "
            "print(gc.isenabled(), gc.get_freeze_count() >= 5000)")
    assert _run(code) == "True True"
