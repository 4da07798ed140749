"""The core process's loop runs deferred set-up while it has no request, and replicas in lockstep
step together (engine/core_process.py)."""
from __future__ import annotations

import threading
import time

import zmq

from octavo.core.protocol import Shutdown, UtilityCall, Wake
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


def _stop(ctx, inputs, loop, proc, *sockets) -> None:
    """Shut the loop down through its input and close everything."""
    inputs.send(encoder.encode(Shutdown()))
    loop.join(10)
    assert not loop.is_alive()
    proc.close()
    for sock in (inputs, *sockets):
        sock.close(linger=0)
    ctx.term()


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
        _stop(ctx, inputs, loop, proc, outputs)


class _SteppingCore(_IdleCore):
    """No idle work until a step asks for some (as a step asks for a CUDA graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.work, self.wanted = 0, False

    def has_unfinished_requests(self) -> bool:
        return self.work > 0

    def step(self):
        self.work -= 1
        self.wanted = True
        return []

    def do_idle_work(self) -> bool:
        self.calls += 1
        self.wanted = False
        return False


def test_idle_work_a_step_asked_for_runs_when_the_engine_next_idles(tmp_path):
    ctx = zmq.Context()
    inputs = ctx.socket(zmq.PUSH)
    inputs.bind(f"ipc://{tmp_path}/in")
    core = _SteppingCore()
    proc = core_process.EngineCoreProcess(core, f"ipc://{tmp_path}/in", f"ipc://{tmp_path}/out")
    proc._send = lambda out: None
    loop = threading.Thread(target=proc.run)
    loop.start()
    try:
        _wait(lambda: core.calls == 1)  # at start; then none is left
        core.work = 3
        inputs.send(encoder.encode(Wake()))
        _wait(lambda: core.work == 0 and not core.wanted)
        assert core.calls == 2  # asked again once the steps were done, and only once
    finally:
        _stop(ctx, inputs, loop, proc)


class _Pair:
    """Two cores' lockstep group in one process: a round's flags are OR-ed at a barrier."""

    def __init__(self) -> None:
        self.flags: dict[int, tuple] = {}
        self.rounds = 0
        self.result = (False, False, False)
        self.barrier = threading.Barrier(2, action=self._combine)

    def _combine(self) -> None:
        self.result = tuple(any(f[i] for f in self.flags.values()) for i in range(3))
        self.rounds += 1

    def member(self, rank: int):
        pair = self

        class Member:
            def agree(self, *flags):
                pair.flags[rank] = flags
                pair.barrier.wait(10)
                return pair.result

            def close(self) -> None:
                pass

        return Member()


class _LockstepCore(_IdleCore):
    """A core with `work` steps to run once given some; counts every step it takes part in."""

    def __init__(self) -> None:
        super().__init__()
        self.work = 0
        self.steps = 0

    def has_unfinished_requests(self) -> bool:
        return self.work > 0

    def step_in_lockstep(self) -> list:
        self.steps += 1
        self.work = max(0, self.work - 1)
        return []


def test_replicas_in_lockstep_step_together_and_set_up_only_while_all_idle(tmp_path):
    """Replicas whose experts span them (core_process._run_in_lockstep): while every one is
    idle, deferred set-up runs between polls without a round per slice; a replica with work
    makes the other take an empty step for each of its steps; a Shutdown to one stops both
    after the same round."""
    ctx = zmq.Context()
    pair = _Pair()
    cores, procs, inputs, loops = [], [], [], []
    for rank in range(2):
        folder = tmp_path / str(rank)
        folder.mkdir()
        sock = ctx.socket(zmq.PUSH)
        sock.bind(f"ipc://{folder}/in")
        inputs.append(sock)
        core = _LockstepCore()
        proc = core_process.EngineCoreProcess(core, f"ipc://{folder}/in", f"ipc://{folder}/out",
                                              pair.member(rank))
        proc._send = lambda outputs: None
        cores.append(core)
        procs.append(proc)
        loops.append(threading.Thread(target=proc.run))
    for loop in loops:
        loop.start()
    try:
        _wait(lambda: cores[0].calls >= 20)
        assert pair.rounds <= 1, pair.rounds  # a round at the idle poll's end, not per slice
        for core in cores:
            core.done.set()
        cores[1].work = 5
        inputs[1].send(encoder.encode(UtilityCall(1, "stats")))
        inputs[0].send(encoder.encode(Wake()))  # as the front end wakes the other replica
        _wait(lambda: cores[1].work == 0)
        time.sleep(0.05)
        assert cores[0].steps == cores[1].steps == 5
    finally:
        inputs[0].send(encoder.encode(Shutdown()))
        for loop in loops:
            loop.join(10)
        assert not any(loop.is_alive() for loop in loops)
        for proc in procs:
            proc.close()
        for sock in inputs:
            sock.close(linger=0)
        ctx.term()
