"""What the executors whose ranks run elsewhere (mp: local processes, ray: Ray actors) share: every
call goes to every rank, in the same order, so the collectives inside a step line up, and is
gathered before the next; only the output rank's ModelOutput comes back from a step (rank =
(pp_rank * cp_size + cp_rank) * tp_size + tp_rank; the output rank is the last stage's first,
ParallelConfig.output_rank). Calls and
replies are the same msgspec messages (`wire.py`, never pickle) whatever carries them: a
subclass only moves bytes to a rank and back (`_post`, `_receive`), says whether a rank is gone
(`_death`) and kills them all (`_kill_workers`, `_stop`).

The KV cache is agreed over the ranks: the least memory available and the largest block (a
pipeline stage with more layers), so that every rank allocates the same number of blocks.

Nothing waits without a bound on a rank that may be gone: replies are polled with a timeout and
the ranks checked between polls. A rank that dies, or fails while the others do not answer within
ERROR_GRACE_S (they are then stuck in a collective with it), fails the executor: every worker is
killed and every later call raises one WorkerFailed naming the rank and its exit or traceback.
An error every rank returns from (an ordinary exception in a step) is raised for that call
alone, as the in-process executor would, and the ranks go on.
"""
from __future__ import annotations

import abc
import logging
import time

from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.executor import wire
from octavo.executor.base import Executor, PendingOutput, blocks_in_budget

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often a wait looks at the ranks: a death is seen this soon
ERROR_GRACE_S = 5.0  # after one rank failed, how long the others may take to answer too


class WorkerFailed(RuntimeError):
    """A rank died or cannot go on: the executor is done."""


class RankExecutor(Executor):
    """The calls and their gathering, over a transport a subclass provides."""

    def __init__(self, config: EngineConfig) -> None:
        parallel = config.parallel
        self.tp_size, self.pp_size = parallel.tensor_parallel_size, parallel.pipeline_parallel_size
        self.world_size = parallel.world_size
        self.output_rank = parallel.output_rank
        self.layout = parallel.layout  # as logs show it
        self.failure: str | None = None
        self.ready = False  # every rank loaded its model
        self.stopped = False
        self.calls = 0
        self._kv_bytes: dict[int, list[int]] = {}
        # Pipeline stages work on a batch each: the core may have pp_size steps in flight, whose
        # replies can arrive in any order across ranks (a first stage answers its next step
        # before the last answers this one); those of a step not gathered yet wait here.
        self.max_concurrent_batches = self.pp_size
        self._in_flight: set[int] = set()
        self._early: dict[int, list[wire.Reply | wire.ExecuteReply]] = {}
        # How many ranks share each rank's memory (those on one machine, on the CPU); a subclass
        # that knows where its ranks run says.
        self.memory_sharers = [1] * self.world_size

    # --- the transport, per subclass ----------------------------------------------------------

    @abc.abstractmethod
    def _post(self, rank: int, payload: bytes) -> None:
        """Send one encoded call to `rank` (raise WorkerFailed through `_fail` if it cannot
        be reached)."""

    @abc.abstractmethod
    def _receive(self, timeout_s: float) -> list[bytes]:
        """Encoded replies that arrived within `timeout_s` (none: the caller checks the ranks)."""

    @abc.abstractmethod
    def _rank_name(self, rank: int) -> str:
        """The rank as a failure names it: 'worker rank 1 (pid 123)'."""

    @abc.abstractmethod
    def _death(self, rank: int) -> str | None:
        """How `rank` died (its exit), or None while it is alive as far as is known."""

    @abc.abstractmethod
    def _kill_workers(self) -> None:
        """Kill every rank now (the executor failed)."""

    @abc.abstractmethod
    def _stop(self) -> None:
        """Wait a few seconds at most for the ranks to exit (asked to already, if they could
        be), kill those left and free what the executor holds. Never waits longer."""

    # --- the Executor interface ---------------------------------------------------------------

    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        states = self._broadcast(wire.StateBytes(self._next_id()), "state_bytes")
        num_blocks = blocks_in_budget(kv_cache_memory,
                                      list(zip(self._block_bytes(block_size), states)))
        got = self._broadcast(wire.InitKVCache(self._next_id(), num_blocks, block_size),
                              "init_kv_cache")
        if len(set(got)) != 1 or (num_blocks and got[0] != num_blocks):
            self._fail(f"the ranks allocated different KV caches: {got} blocks, "
                       f"{num_blocks} agreed")
        return got[0]  # an encoder's count where no rank caches

    def kv_bytes_per_block(self, block_size: int) -> int:
        return max(self._block_bytes(block_size))

    def available_memory(self) -> int | None:
        free = self._broadcast(wire.AvailableMemory(self._next_id()), "available_memory")
        if any(f is None for f in free):
            return None
        # Each rank reports its machine's free memory; ranks sharing it get a share each.
        return min(f // n for f, n in zip(free, self.memory_sharers))

    def describe(self) -> str:
        return self._broadcast(wire.Describe(self._next_id()), "describe")[0]

    def do_idle_work(self) -> bool:
        return any(self._broadcast(wire.DoIdleWork(self._next_id()), "do_idle_work"))

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        return self.execute_async(scheduler_output).result()

    def execute_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        call = wire.Execute(self._next_id(), scheduler_output)
        self._broadcast(call, "execute", gather=False)
        self._in_flight.add(call.call_id)
        return _PendingStep(self, call.call_id)

    def check_health(self) -> None:
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        for rank in range(self.world_size):
            how = self._death(rank)
            if how is not None:
                self._fail(f"{self._rank_name(rank)} died: {how}")

    def shutdown(self) -> None:
        """Ask the ranks to exit, kill those still there after a few seconds; never waits
        longer, whatever state they are in. Twice is fine."""
        if self.stopped:
            return
        self.stopped = True
        if self.failure is None and self.ready:
            try:
                self._broadcast(wire.Shutdown(self._next_id()), "shutdown", gather=False)
            except WorkerFailed:
                pass
        elif self.failure is None:  # still loading (the start was interrupted): nothing to wait for
            self._kill_workers()
        self._stop()
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
        self._post(rank, wire.encoder.encode(call))

    def _broadcast(self, call: wire.Call, what: str, gather: bool = True,
                   timeout_s: float | None = None) -> list:
        """Send `call` to every rank, encoded once; every rank's result, in rank order (with
        `gather`; else the replies are left to `_stop`)."""
        if self.failure is not None:
            raise WorkerFailed(self.failure)
        payload = wire.encoder.encode(call)
        for rank in range(self.world_size):
            self._post(rank, payload)
        return self._gather(call.call_id, what, timeout_s) if gather else []

    def _gather(self, call_id: int, what: str, timeout_s: float | None = None) -> list:
        """Every rank's reply to `call_id`. Raises WorkerFailed (every worker killed) when a
        rank dies, the others do not answer within ERROR_GRACE_S of a rank's error, or (with
        `timeout_s`) any rank does not answer in time; a RuntimeError for an error all ranks
        returned from."""
        values: dict[int, object] = {}
        errors: dict[int, str] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        grace_until: float | None = None
        early = self._early.pop(call_id, [])
        self._in_flight.discard(call_id)
        while len(values) + len(errors) < self.world_size:
            replies = early or [wire.reply_decoder.decode(data)
                                for data in self._receive(POLL_S)]
            early = []
            for reply in replies:
                if reply.call_id != call_id:
                    self._keep_early(reply, what, call_id)
                    continue
                if reply.error is not None:
                    errors[reply.rank] = reply.error
                    grace_until = grace_until or time.monotonic() + ERROR_GRACE_S
                else:
                    values[reply.rank] = (reply.output if isinstance(reply, wire.ExecuteReply)
                                          else reply.value)
            if replies:
                continue
            for rank in range(self.world_size):
                how = None if rank in values or rank in errors else self._death(rank)
                if how is not None:
                    self._fail(f"{self._rank_name(rank)} died during {what}: {how}"
                               + _first_error(errors))
            missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
            if grace_until is not None and time.monotonic() > grace_until:
                self._fail(f"rank(s) {missing} did not answer {what} within {ERROR_GRACE_S:g} s "
                           f"of another rank's error" + _first_error(errors))
            if deadline is not None and time.monotonic() > deadline:
                self._fail(f"rank(s) {missing} did not answer {what} within {timeout_s:g} s")
        if errors:
            message = f"{what} failed" + _first_error(errors)
            if call_id == wire.READY_CALL_ID:
                self._fail(message)
            raise RuntimeError(message)
        if call_id == wire.READY_CALL_ID:
            self.ready = True
        return [values[rank] for rank in range(self.world_size)]

    def _keep_early(self, reply: wire.Reply | wire.ExecuteReply, what: str,
                    call_id: int) -> None:
        if reply.call_id not in self._in_flight:
            self._fail(f"worker rank {reply.rank} answered call {reply.call_id} while "
                       f"{what} (call {call_id}) was waiting")
        self._early.setdefault(reply.call_id, []).append(reply)

    def _step_done(self, call_id: int) -> bool:
        """Whether every rank has answered step `call_id`, without waiting."""
        while len(self._early.get(call_id, ())) < self.world_size:
            replies = self._receive(0)
            if not replies:
                return False
            for data in replies:
                self._keep_early(wire.reply_decoder.decode(data), "execute", call_id)
        return True

    def _fail(self, message: str) -> None:
        """The executor cannot go on: kill every worker, remember why, raise it."""
        if self.failure is None:
            self.failure = message
            logger.error("%s failed: %s", type(self).__name__, message)
            self._kill_workers()
        raise WorkerFailed(self.failure)


def _first_error(errors: dict[int, str]) -> str:
    if not errors:
        return ""
    rank = min(errors)
    lines = errors[rank].strip().splitlines()
    return f"; worker rank {rank} raised {lines[-1]}\n{errors[rank]}"


class _PendingStep(PendingOutput):
    """A step sent to every rank; its output rank's ModelOutput once gathered."""

    def __init__(self, executor: RankExecutor, call_id: int) -> None:
        self.executor, self.call_id = executor, call_id

    def done(self) -> bool:
        return self.executor.failure is not None or self.executor._step_done(self.call_id)

    def result(self) -> ModelOutput:
        return self.executor._gather(self.call_id, "execute")[self.executor.output_rank]
