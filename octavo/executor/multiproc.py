"""The mp executor: one local worker process per rank (mp_worker.py), every call broadcast and
gathered as ranks.py does it, over one ZeroMQ ROUTER socket that each rank's DEALER answers on.
A rank's death is seen from its process (polled between replies); whatever happens to this
object, its processes and socket folder go with it.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

import zmq

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.executor import wire
from octavo.executor.mp_worker import rank_identity
from octavo.distributed.lockstep import free_port
from octavo.distributed.placement import local_ranks
from octavo.executor.ranks import RankExecutor, WorkerFailed
from octavo.model_source import ModelSource

logger = logging.getLogger(__name__)

__all__ = ["MultiprocExecutor", "WorkerFailed"]

SHUTDOWN_GRACE_S = 5.0  # how long workers may take to exit when asked before they are killed


class MultiprocExecutor(RankExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int]) -> None:
        super().__init__(config)
        if config.device.device == "cpu":  # local ranks on the CPU share the machine's memory
            self.memory_sharers = [self.world_size] * self.world_size
        self.ipc_dir = tempfile.mkdtemp(prefix="octavo-workers-")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a gone rank raises
        self.sock.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self.ipc_dir}/calls"
        self.sock.bind(address)
        init_method = (config.parallel.replica_init_method
                       or f"tcp://127.0.0.1:{free_port()}")
        self.procs: list[subprocess.Popen] = []
        # Whatever happens to this object (never shut down, collected, the interpreter
        # exiting), its processes, socket and socket folder go with it. The finalizer holds the
        # socket and its context: left to the collector, a context can be collected after its
        # socket's weak reference is cleared, and its term() then waits forever on that socket.
        self._finalizer = weakref.finalize(self, _release, self.procs, self.ipc_dir, self.sock,
                                           self.ctx)
        try:
            for rank, (local_rank, local_size) in enumerate(
                    local_ranks(["this machine"] * self.world_size)):
                spec = wire.WorkerSpec(
                    rank, self.tp_size, self.pp_size, local_rank, local_size, init_method,
                    logging.getLogger().getEffectiveLevel(), config, source, arch,
                    max_model_len, list(eos_token_ids))
                self.procs.append(_start(wire.ProcessStart(address, os.getpid(), spec)))
            self._gather(wire.READY_CALL_ID, "start-up (loading the model)")
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d worker processes (%s), pids %s", self.world_size,
                    self.layout, [p.pid for p in self.procs])

    def describe(self) -> str:
        return (f"{super().describe()}, {self.world_size} worker processes "
                f"({self.layout})")

    # --- the transport ------------------------------------------------------------------------

    def _post(self, rank: int, payload: bytes) -> None:
        try:
            self.sock.send_multipart([rank_identity(rank), payload], copy=False)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the rank's socket is gone
            self.check_health()
            self._fail(f"worker rank {rank} cannot be reached: {exc}")

    def _receive(self, timeout_s: float) -> list[bytes]:
        if not self.sock.poll(int(timeout_s * 1000)):
            return []
        return [self.sock.recv_multipart()[-1]]

    def _rank_name(self, rank: int) -> str:
        return f"worker rank {rank} (pid {self.procs[rank].pid})"

    def _death(self, rank: int) -> str | None:
        if rank >= len(self.procs) or self.procs[rank].poll() is None:
            return None
        return _exit(self.procs[rank])

    def _kill_workers(self) -> None:
        _reap(self.procs, None)

    def _stop(self) -> None:
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # kills what is left, removes the socket folder, closes the socket


def _exit(proc: subprocess.Popen) -> str:
    code = proc.returncode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name} (exit code {code})"
    return f"exit code {code}"


def _start(start: wire.ProcessStart) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "octavo.executor.mp_worker"],
                            stdin=subprocess.PIPE)
    try:
        proc.stdin.write(wire.encoder.encode(start))
        proc.stdin.close()
    except OSError:  # it died already; _gather reports its exit
        pass
    return proc


def _release(procs: list[subprocess.Popen], ipc_dir: str, sock: zmq.Socket,
             ctx: zmq.Context) -> None:
    _reap(procs, ipc_dir)
    sock.close(linger=0)
    ctx.term()


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
