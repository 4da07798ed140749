"""The engine core's own process: a busy loop of (drain inputs → step → send outputs).

It never waits on HTTP, tokenization or detokenization: the front end sends ready-made requests
and gets one message per step with every request's new tokens (outputs are coalesced per step).
It dies with its front end: the kernel sends it SIGKILL when the parent exits (Linux's
PR_SET_PDEATHSIG), and the loop also checks its parent at least once a second.

This is one of the core's two hosts (with client.py): it builds the core through its entry point
(`create_engine_core`) and speaks to it, and to the front end, only in the protocol's messages.
"""
from __future__ import annotations

import logging
import os
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import zmq

from octavo import startup_gc
from octavo.config import EngineConfig
from octavo.core.engine_core import EngineCore, create_engine_core, import_model_side
from octavo.distributed import ray_cluster
from octavo.distributed.lockstep import ReplicaLockstep, free_port
from octavo.distributed.placement import rank_cpus
from octavo.core.protocol import (
    AbortRequests,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    Shutdown,
    UtilityCall,
)
from octavo.engine.grammar import XgrammarBackend
from octavo.engine.messages import encoder, input_decoder
from octavo.lifetime import die_with_parent

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
HEALTH_CHECK_S = 1.0  # while idle, how often the executor's workers are checked


class EngineCoreProcess:
    def __init__(self, core: EngineCore, input_addr: str, output_addr: str,
                 lockstep: ReplicaLockstep | None = None) -> None:
        """lockstep: the replicas' group, where the experts span them (each round, every core
        steps, an empty step where it has nothing to run)."""
        self.core = core
        self.lockstep = lockstep
        self.ctx = zmq.Context()
        self.inputs = self.ctx.socket(zmq.PULL)
        self.inputs.connect(input_addr)
        self.outputs = self.ctx.socket(zmq.PUSH)
        self.outputs.connect(output_addr)
        self.running = True
        self.parent = os.getppid()
        self._checked = time.monotonic()  # the workers' last health check

    def run(self) -> None:
        if self.lockstep is not None:
            self._run_in_lockstep()
            return
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        idle_work = True  # until the executor says it has none left (steps may make more)
        while self.running:
            if self._parent_gone():
                return
            busy = self.core.has_unfinished_requests()
            if not busy:
                self._check_health()
            if not busy and idle_work:
                # Deferred set-up (packing weights) in slices of a few ms between polls: a
                # server started ahead of its traffic meets the first requests fully set up.
                idle_work = self.core.do_idle_work()
            changed = self._drain(poller, 0 if busy or idle_work else IDLE_POLL_MS)
            if not self.running:
                return
            if self.core.has_unfinished_requests():
                self._send(CoreOutputs(self.core.step(), self.core.stats()))
                idle_work = True  # a step may have asked for a CUDA graph
            elif changed:
                self._send(CoreOutputs([], self.core.stats()))  # e.g. usage after an abort

    def _run_in_lockstep(self) -> None:
        """The loop of a replica whose experts span the others: every pass is one round of the
        lockstep group, after which either every replica steps (an empty step where it has no
        work) or none does. Its deferred set-up runs while every replica is idle, between polls
        of the idle wait, so that it never holds the others' rounds."""
        poller = zmq.Poller()
        poller.register(self.inputs, zmq.POLLIN)
        idle_work = True
        peers_active = False  # a replica had work or news at the last round
        while True:
            if self._parent_gone():
                return
            busy = self.core.has_unfinished_requests()
            timeout = 0
            if not busy and not peers_active:
                self._check_health()
                deadline = time.monotonic() + IDLE_POLL_MS / 1000
                while idle_work and time.monotonic() < deadline and not poller.poll(0):
                    idle_work = self.core.do_idle_work()
                timeout = max(0, round((deadline - time.monotonic()) * 1000))
            changed = self._drain(poller, timeout)
            busy, peers_active, stopping = self.lockstep.agree(
                self.core.has_unfinished_requests(), changed, not self.running)
            if stopping:  # every replica leaves after the same round
                return
            if busy:
                local = self.core.has_unfinished_requests()
                outputs = self.core.step_in_lockstep()
                if local or changed:
                    self._send(CoreOutputs(outputs, self.core.stats()))
            elif changed:
                self._send(CoreOutputs([], self.core.stats()))
            peers_active |= busy

    def _parent_gone(self) -> bool:
        if os.getppid() != self.parent:  # the front end is gone (and PDEATHSIG missed it)
            logger.error("the front end (pid %d) is gone; the engine core exits", self.parent)
            return True
        return False

    def _check_health(self) -> None:
        """While idle, at most every HEALTH_CHECK_S: a worker that died while nothing ran ends
        the core now (the front end then answers /health with 503), not at the next request;
        a step sees it itself."""
        if time.monotonic() - self._checked >= HEALTH_CHECK_S:
            self.core.executor.check_health()
            self._checked = time.monotonic()

    def _drain(self, poller: zmq.Poller, timeout: int) -> bool:
        """Handle the messages that come within `timeout` ms (then every one waiting, until a
        Shutdown); whether there were any."""
        changed = False
        while self.running and poller.poll(timeout):
            self._receive(self.inputs.recv())
            changed = True
            timeout = 0
        return changed

    def _receive(self, data: bytes) -> None:
        try:
            msg = input_decoder.decode(data)
        except msgspec.DecodeError as exc:  # validated by the front end; never kill the loop
            req_id = _request_id(data)
            if req_id is None:
                logger.error("dropped a message the core cannot read: %s", exc)
                return
            self._reject(req_id, exc)
            return
        self._handle(msg)

    def _reject(self, req_id: str, exc: Exception) -> None:
        logger.error("rejected request %s: %s", req_id, exc)
        self._send(CoreOutputs([EngineCoreOutput(
            req_id, [], "abort", f"error: {type(exc).__name__}: {exc}"[:500])],
            self.core.stats()))

    def _handle(self, msg) -> None:
        if isinstance(msg, EngineCoreRequest):
            try:
                self.core.add_request(msg)
            except Exception as exc:  # validated by the front end; never kill the loop
                self._reject(msg.req_id, exc)
        elif isinstance(msg, AbortRequests):
            self.core.abort_requests(msg.req_ids)
        elif isinstance(msg, UtilityCall):
            result, error = None, None
            try:
                if msg.method == "stats":
                    result = self.core.stats()
                elif msg.method == "reset_prefix_cache":
                    result = self.core.reset_prefix_cache()
                else:
                    error = f"unknown utility {msg.method!r}"
            except Exception as exc:  # reported to the caller, the loop goes on
                error = f"{type(exc).__name__}: {exc}"
            self._send(CoreOutputs([], self.core.stats(), msg.call_id, result, error))
        elif isinstance(msg, Shutdown):
            self.running = False
        # Wake: nothing to do; its arrival is what the next lockstep round hears of

    def _send(self, outputs: CoreOutputs) -> None:
        self.outputs.send(encoder.encode(outputs), copy=False)

    def close(self) -> None:
        self.core.shutdown()
        if self.lockstep is not None:
            self.lockstep.close()
        self.inputs.close(linger=0)
        self.outputs.close(linger=0)
        self.ctx.term()


def _request_id(data: bytes) -> str | None:
    """The id of the request in a message that did not decode as its type (its sampling
    parameters, say), so that the request is answered instead of left waiting."""
    try:
        msg = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(msg, dict) and msg.get("type") == "EngineCoreRequest" \
            and isinstance(msg.get("req_id"), str):
        return msg["req_id"]
    return None


def run_engine_core(config: EngineConfig, setup: Connection, input_addr: str, output_addr: str,
                    ready: Connection, log_level: int, replica: int = 0,
                    replicas: int = 1) -> None:
    """Entry point of the core process. It starts before the front end has read the model's
    config and tokenizer: it imports torch meanwhile, then takes (source, arch, max_model_len,
    eos_token_ids) from `setup` (closed unsent: the front end failed, and so the core quits).
    Data-parallel replica `replica` of `replicas` first takes its share of the cores (its
    ranks then split that share, distributed/placement.py)."""
    startup_gc.pause()  # until the core is ready (a forked core inherits its parent's pause)
    pin_replica(config, replica, replicas)
    if not die_with_parent():
        logger.warning("PR_SET_PDEATHSIG unavailable: the engine core checks its parent in its "
                       "loop instead")
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    if replicas > 1:
        logger.info("data-parallel replica %d of %d: cores %s", replica, replicas,
                    sorted(os.sched_getaffinity(0)))
    # The front end owns SIGINT/SIGTERM and shuts the core down through a message.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    import_model_side()
    try:
        core_args = setup.recv()
    except EOFError:
        return
    setup.close()
    try:
        core = build_core(config, core_args)
    except BaseException as exc:
        ready.send(("error", (type(exc).__name__, str(exc))))
        raise
    proc = EngineCoreProcess(core, input_addr, output_addr, join_replicas(config))
    startup_gc.settle()
    ready.send(("ready", ready_info(core)))
    try:
        proc.run()
    finally:
        proc.close()


def pin_replica(config: EngineConfig, replica: int, replicas: int) -> None:
    """Data-parallel replica `replica` of the `replicas` on this machine takes its share of the
    cores (cpu_binding auto); its ranks then split that share (distributed/placement.py)."""
    if replicas > 1 and config.parallel.cpu_binding == "auto":
        os.sched_setaffinity(0, rank_cpus(replica, replicas, list(os.sched_getaffinity(0))))


def join_replicas(config: EngineConfig) -> ReplicaLockstep | None:
    """The replicas' lockstep group, where the experts span them (after the core is built:
    its ranks have joined the others' world by then)."""
    parallel = config.parallel
    if not parallel.experts_span_replicas:
        return None
    return ReplicaLockstep(parallel.data_parallel_rank, parallel.data_parallel_size,
                           parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port)


def build_core(config: EngineConfig, core_args: tuple) -> EngineCore:
    """The engine core from the front end's (source, arch, max_model_len, eos_token_ids)."""
    source, arch, max_model_len, eos_token_ids = core_args

    def grammar_backend() -> XgrammarBackend:  # on the first constrained request
        from octavo.engine.tokenizer import load_tokenizer

        return XgrammarBackend(load_tokenizer(source, config.model.tokenizer), arch.vocab_size,
                               eos_token_ids)

    return create_engine_core(config, source, arch, max_model_len, eos_token_ids,
                              grammar_backend)


def ready_info(core: EngineCore) -> dict:
    """What the front end learns of a core once it is ready."""
    return {"num_blocks": core.num_blocks, "pid": os.getpid(),
            "max_model_len": core.max_model_len, "loaded": core.describe()}


class RayEngineCore:
    """The class a data-parallel replica's Ray actor is made of (core_launch_ray.py): the same
    core and loop as the process above, in a Ray worker process on any machine of the cluster,
    speaking to the front end over TCP. `start` builds the core and answers what the ready pipe
    says; `run` is the loop, to the Shutdown message (its end is how the front end sees the
    core stop)."""

    def __init__(self) -> None:
        self.proc: EngineCoreProcess | None = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP address, pid) of this actor."""
        return ray_cluster.where()

    def free_port(self) -> int:
        """A TCP port free now on this node, where replicas in lockstep meet."""
        return free_port("")

    def start(self, config: EngineConfig, core_args: tuple, input_addr: str, output_addr: str,
              log_level: int, replica: int, replicas: int) -> dict:
        """`replica` of the `replicas` on this machine."""
        logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
        pin_replica(config, replica, replicas)
        import_model_side()
        core = build_core(config, core_args)
        self.proc = EngineCoreProcess(core, input_addr, output_addr, join_replicas(config))
        return ready_info(core)

    def run(self) -> None:
        if self.proc is None:
            raise RuntimeError("the engine core did not start")
        try:
            self.proc.run()
        finally:
            self.proc.close()
