"""The mp executor: one local worker process per rank (rank = pp_rank * tp_size + tp_rank).

Every call goes to every rank, in the same order, so the collectives inside a step line up; each
rank answers every call over one ZeroMQ ROUTER socket (`wire.py`: msgspec, never pickle). Only
the output rank's ModelOutput comes back from a step. The KV cache is agreed over the ranks: the
least memory available and the largest block (a pipeline stage with more layers), so that every
rank allocates the same number of blocks.

Nothing here waits without a bound on a rank that may be gone: the socket is polled with a
timeout and the processes checked between polls. A rank that dies, or fails while the others do
not answer within ERROR_GRACE_S (they are then stuck in a collective with it), fails the
executor: every process is killed and every later call raises one RuntimeError naming the rank,
its exit code or traceback. An error every rank returns from (an ordinary exception in a step)
is raised for that call alone, as the in-process executor would, and the ranks go on.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref

import zmq

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.executor import wire
from octavo.executor.base import Executor
from octavo.executor.mp_worker import rank_identity
from octavo.model_source import ModelSource

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often a wait looks at the processes: a death is seen this soon
ERROR_GRACE_S = 5.0  # after one rank failed, how long the others may take to answer too
SHUTDOWN_GRACE_S = 5.0  # how long workers may take to exit when asked before they are killed


class WorkerFailed(RuntimeError):
    """A rank died or cannot go on: the executor is done."""


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int]) -> None:
        parallel = config.parallel
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        self.output_rank = (self.pp_size - 1) * self.tp_size
        # Local ranks on the CPU share the machine's memory; a GPU rank has its own.
        self.shares_memory = config.device.device == "cpu"
        self.failure: str | None = None
        self.calls = 0
        self._kv_bytes: dict[int, list[int]] = {}
        self.ipc_dir = tempfile.mkdtemp(prefix="octavo-workers-")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone rank raises
        self.sock.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self.ipc_dir}/calls"
        self.sock.bind(address)
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[subprocess.Popen] = []
        # Whatever happens to this object (never shut down, collected, the interpreter
        # exiting), its processes and socket folder go with it.
        self._finalizer = weakref.finalize(self, _reap, self.procs, self.ipc_dir)
        try:
            for rank in range(self.world_size):
                spec = wire.WorkerSpec(
                    rank, self.tp_size, self.pp_size, init_method, address, os.getpid(),
                    logging.getLogger().getEffectiveLevel(), config, source, arch,
                    max_model_len, list(eos_token_ids))
                self.procs.append(_start(spec))
            self._gather(wire.READY_CALL_ID, "start-up (loading the model)")
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d worker processes (tp %d, pp %d), pids %s", self.world_size,
                    self.tp_size, self.pp_size, [p.pid for p in self.procs])

    # --- the Executor interface ---------------------------------------------------------------

    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        per_rank = self._block_bytes(block_size)
        num_blocks = kv_cache_memory // max(per_rank)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({kv_cache_memory} bytes) is smaller than one "
                             f"block ({max(per_rank)} bytes on the largest rank)")
        call_id = self._next_id()
        for rank, nbytes in enumerate(per_rank):
            self._send(rank, wire.InitKVCache(call_id, num_blocks * nbytes, block_size))
        got = self._gather(call_id, "init_kv_cache")
        if set(got) != {num_blocks}:
            self._fail(f"the ranks allocated different KV caches: {got} blocks, "
                       f"{num_blocks} agreed")
        return num_blocks

    def kv_bytes_per_block(self, block_size: int) -> int:
        return max(self._block_bytes(block_size))

    def available_memory(self) -> int | None:
        free = self._broadcast(wire.AvailableMemory(self._next_id()), "available_memory")
        if any(f is None for f in free):
            return None
        # Each rank reports the machine's free memory; ranks sharing it get a share each.
        return min(free) // (self.world_size if self.shares_memory else 1)

    def describe(self) -> str:
        first = self._broadcast(wire.Describe(self._next_id()), "describe")[0]
        return f"{first}, {self.world_size} worker processes (tp {self.tp_size}, pp {self.pp_size})"

    def do_idle_work(self) -> bool:
        return any(self._broadcast(wire.DoIdleWork(self._next_id()), "do_idle_work"))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        return self._broadcast(wire.Execute(self._next_id(), scheduler_output),
                               "execute")[self.output_rank]

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        for rank, proc in enumerate(self.procs):
            if proc.poll() is not None:
                self._fail(f"worker rank {rank} (pid {proc.pid}) died: {_exit(proc)}")

    def shutdown(self) -> None:
        """Ask the workers to exit, kill those still there after SHUTDOWN_GRACE_S; never
        waits longer, whatever state they are in."""
        if self.sock.closed:
            return
        if self.failure is None and len(self.procs) == self.world_size:
            call_id = self._next_id()
            for rank in range(self.world_size):
                try:
                    self._send(rank, wire.Shutdown(call_id))
                except (zmq.ZMQError, WorkerFailed):
                    break
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # kills what is left, removes the socket folder
        self.sock.close(linger=0)
        self.ctx.term()
        if self.failure is None:
            self.failure = "the executor was shut down"

    # --- calls and replies --------------------------------------------------------------------

    def _next_id(self) -> int:
        self.calls += 1
        return self.calls

    def _block_bytes(self, block_size: int) -> list[int]:
        if block_size not in self._kv_bytes:
            self._kv_bytes[block_size] = self._broadcast(
                wire.KVBytesPerBlock(self._next_id(), block_size), "kv_bytes_per_block")
        return self._kv_bytes[block_size]

    def _send(self, rank: int, call: wire.Call) -> None:
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        try:
            self.sock.send_multipart([rank_identity(rank), wire.encoder.encode(call)],
                                     copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the rank's socket is gone
            self.check_health()
            self._fail(f"worker rank {rank} cannot be reached: {exc}")

    def _broadcast(self, call: wire.Call, what: str) -> list:
        """Send `call` to every rank, encoded once; every rank's result, in rank order."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        payload = wire.encoder.encode(call)
        for rank in range(self.world_size):
            try:
                self.sock.send_multipart([rank_identity(rank), payload], copy=False)
            except zmq.ZMQError as exc:
                self.check_health()
                self._fail(f"worker rank {rank} cannot be reached: {exc}")
        return self._gather(call.call_id, what)

    def _gather(self, call_id: int, what: str) -> list:
        """Every rank's reply to `call_id`. Raises WorkerFailed (all processes killed) when a
        rank dies or the others do not answer within ERROR_GRACE_S of a rank's error; a
        RuntimeError for an error all ranks returned from."""
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        grace_until: float | None = None
        while len(values) + len(errors) < self.world_size:
            if self.sock.poll(POLL_MS):
                reply = wire.reply_decoder.decode(self.sock.recv_multipart()[-1])
                if reply.call_id != call_id:
                    self._fail(f"worker rank {reply.rank} answered call {reply.call_id} while "
                               f"{what} (call {call_id}) was waiting")
                if reply.error is not None:
                    errors[reply.rank] = reply.error
                    grace_until = grace_until or time.monotonic() + ERROR_GRACE_S
                else:
                    values[reply.rank] = (reply.output if isinstance(reply, wire.ExecuteReply)
                                          else reply.value)
                continue
            for rank, proc in enumerate(self.procs):
                if rank not in values and rank not in errors and proc.poll() is not None:
                    self._fail(f"worker rank {rank} (pid {proc.pid}) died during {what}: "
                               f"{_exit(proc)}" + _first_error(errors))
            if grace_until is not None and time.monotonic() > grace_until:
                missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                self._fail(f"rank(s) {missing} did not answer {what} within {ERROR_GRACE_S:g} s "
                           f"of another rank's error" + _first_error(errors))
        if errors:
            message = f"{what} failed" + _first_error(errors)
            if call_id == wire.READY_CALL_ID:
                self._fail(message)
            raise RuntimeError(message)
        return [values[rank] for rank in range(self.world_size)]

    def _fail(self, message: str) -> None:
        """The executor cannot go on: kill every worker, remember why, raise it."""
        if self.failure is None:
            self.failure = message
            logger.error("mp executor failed: %s", message)
            _reap(self.procs, None)
        raise WorkerFailed(self.failure)


def _first_error(errors: dict[int, str]) -> str:
    if not errors:
        return ""
    rank = min(errors)
    lines = errors[rank].strip().splitlines()
    return f"; worker rank {rank} raised {lines[-1]}\n{errors[rank]}"


def _exit(proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


def _start(spec: wire.WorkerSpec) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "octavo.executor.mp_worker"],
                            stdin=subprocess.PIPE)
    try:
        proc.stdin.write(wire.encoder.encode(spec))
        proc.stdin.close()
    except OSError:  # it died already; _gather reports its exit
        pass
    return proc


def _reap(procs: list[subprocess.Popen], ipc_dir: str | None) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(SHUTDOWN_GRACE_S)
        except subprocess.TimeoutExpired:  # unkillable (D state): nothing more to do
            logger.error("worker pid %d did not exit after SIGKILL", proc.pid)
    if ipc_dir is not None:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _free_port() -> int:
    """A TCP port free now on the loopback, for the ranks' torch.distributed rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
