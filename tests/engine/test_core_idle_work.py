"""The core process's loop runs deferred set-up while it has no request (engine/core_process.py)."""
from __future__ import annotations

import threading
import time

import zmq

from octavo.core.protocol import Shutdown, UtilityCall
from octavo.engine import core_process
from octavo.engine.messages import encoder


class _IdleCore:
    """A core with no requests and idle work until `done` is set."""

    def __init__(self) -> None:
        self.calls = 0
        self.done = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return False

    def do_idle_work(self) -> bool:
        self.calls += 1
        time.sleep(0.002)
        return not self.done.is_set()

    def stats(self):
        return None

    @property
    def executor(self):  # the loop checks the workers' health while idle
        return self

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_idle_work_runs_between_polls_answers_inputs_and_then_stops(tmp_path):
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PUSH)
    inputs.bind(f"ipc://{tmp_path}/in")
    outputs = ctx.socket(zmq.PULL)
    outputs.bind(f"ipc://{tmp_path}/out")
    core = _IdleCore()
    proc = core_process.EngineCoreProcess(core, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    sent = []
    proc._send = sent.append
    loop = threading.Thread(target=proc.run)
    loop.start()
    try:
        _wait(lambda: core.calls >= 3)
        inputs.send(encoder.encode(UtilityCall(7, "nope")))  # answered between two slices
        _wait(lambda: sent)
        assert sent[0].utility_call_id == 7 and "unknown utility" in sent[0].utility_error
        assert not core.done.is_set()
        core.done.set()
        time.sleep(0.1)  # the slice that sees `done` is the last
        calls = core.calls
        time.sleep(0.3)
        assert core.calls == calls  # no work left: the loop waits for input, it does not spin
    finally:
        inputs.send(encoder.encode(Shutdown()))
        loop.join(10)
        assert not loop.is_alive()
        proc.close()
        inputs.close(linger=0)
        outputs.close(linger=0)
        ctx.term()
