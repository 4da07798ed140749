"""One engine core process as the server's front end holds it: its two sockets, its last stats,
whether it is alive, the requests placed on it and its utility calls in flight.

With data parallelism (`--data-parallel-size N`) the front end holds N of them
(async_engine.py), each a replica of the model with its own scheduler, KV cache and executor
(itself tensor or pipeline parallel as configured). A replica that dies fails only its own
requests; the router (replica_router.py) sends new ones to the others. Replicas whose experts
span each other (expert parallelism) are `linked`: they step in lockstep, so a message to one
wakes the others too, and one's death is all of theirs (its experts are gone).

The cores leave SIGTERM to their front end (core_process.py), so multiprocessing's own exit
hook, which terminates and then joins its daemon children, would wait on them forever: a front
end that is never shut down (a script that simply ends) stops its cores through `CoreStopper`,
run at the interpreter's exit ahead of that hook, or when the front end is collected.
"""
from __future__ import annotations

import asyncio
import atexit
import time
import weakref

import zmq
import zmq.asyncio

from octavo.core.protocol import SchedulerStats, Shutdown, Wake
from octavo.engine.core_launch import CoreLaunch
from octavo.engine.messages import encoder


class CoreReplica:
    def __init__(self, index: int, launch: CoreLaunch, ctx: zmq.asyncio.Context) -> None:
        self.index = index
        self.launch = launch
        self.to_core = ctx.socket(zmq.PUSH)
        self.to_core.bind(launch.input_addr)
        self.from_core = ctx.socket(zmq.PULL)
        self.from_core.bind(launch.output_addr)
        # A core on another machine (Ray) is told the ports bound here, in its setup.
        launch.input_addr = self.to_core.getsockopt_string(zmq.LAST_ENDPOINT)
        launch.output_addr = self.from_core.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stats = SchedulerStats(0, 0, 0.0, 0)
        self.dead: str | None = None
        self.last_heard = time.monotonic()  # the core's last message
        self.num_blocks: int | None = None
        self.loaded = ""  # what the core loaded (Executor.describe), once it is ready
        self.max_model_len = 0
        self.requests: set[str] = set()  # the front end's unfinished requests placed here
        self.sequences = 0  # their sequences: the load the router balances
        self.pending_calls: dict[int, asyncio.Future] = {}
        self.tasks: list[asyncio.Task] = []  # its output reader and process watchdog
        self.linked: list[CoreReplica] = []  # the other replicas it steps in lockstep with

    @property
    def process(self):
        return self.launch.process

    def wait_until_ready(self) -> None:
        """Block until the core has loaded the model; its failure raised as the core's (a bad
        setting as ValueError)."""
        while not self.launch.ready.poll(1.0):
            if not self.process.is_alive():
                raise RuntimeError(f"engine core {self.index} exited during start-up "
                                   f"(code {self.process.exitcode})")
        kind, info = self.launch.ready.recv()
        if kind != "ready":
            self.process.join(5)
            error_type, message = info
            if error_type == "ValueError":  # a bad setting (a KV budget past free memory, ...)
                raise ValueError(message)
            raise RuntimeError(f"engine core failed to start: {error_type}: {message}")
        self.num_blocks = info["num_blocks"]
        self.max_model_len = info["max_model_len"]
        self.loaded = info["loaded"]
        self.pid = info["pid"]

    def send(self, data: bytes) -> None:
        """Queue an encoded message for the core (not awaited; dropped once it is dead), and
        wake the replicas linked to it."""
        if self.dead is None:
            self.to_core.send(data)
            for other in self.linked:
                if other.dead is None:
                    other.to_core.send(_WAKE)

    def place(self, request_id: str, sequences: int) -> None:
        self.requests.add(request_id)
        self.sequences += sequences

    def release(self, request_id: str, sequences: int) -> None:
        if request_id in self.requests:
            self.requests.discard(request_id)
            self.sequences -= sequences

    def silent_for(self) -> float:
        return time.monotonic() - self.last_heard

    def ask_to_stop(self) -> None:
        """Ask the core to shut down, from any thread."""
        if self.process.is_alive():
            try:  # a plain socket over the same handle: no event loop is needed to send
                zmq.Socket.shadow(self.to_core.underlying).send(encoder.encode(Shutdown()))
            except zmq.ZMQError:
                pass

    def wait_stopped(self, timeout_s: float = 10.0) -> None:
        """After ask_to_stop: killed if it has not stopped within timeout_s."""
        self.process.join(timeout_s)
        if self.process.is_alive():
            self.process.kill()

    def close_sockets(self) -> None:
        self.to_core.close(linger=0)
        self.from_core.close(linger=0)
        self.launch.release()


class CoreStopper:
    """Stops a front end's cores and closes its sockets and context: once, when called (its
    shutdown), when the front end is collected, or at the interpreter's exit."""

    def __init__(self, front_end: object, replicas: list[CoreReplica], ctx: zmq.Context) -> None:
        self._finalize = weakref.finalize(front_end, _stop_cores, replicas, ctx)
        # atexit runs the last registered first: this before multiprocessing's hook, which the
        # cores' start registered.
        atexit.register(self._finalize)

    def __call__(self) -> None:
        atexit.unregister(self._finalize)
        self._finalize()


def link(replicas: list[CoreReplica]) -> None:
    """Replicas that step in lockstep (their experts span them) wake and die together."""
    for replica in replicas:
        replica.linked = [other for other in replicas if other is not replica]


def _stop_cores(replicas: list[CoreReplica], ctx: zmq.Context) -> None:
    # every core is asked first: replicas in lockstep leave together, after one round
    for replica in replicas:
        replica.ask_to_stop()
    for replica in replicas:
        replica.wait_stopped()
        replica.close_sockets()
    ctx.term()


_WAKE = encoder.encode(Wake())
