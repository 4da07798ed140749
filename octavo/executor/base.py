"""The executor interface the core talks to. Torch-free, so the core can import it; the concrete
executors (and torch with them) are imported only by `Executor.create`."""
from __future__ import annotations

import abc

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.model_source import ModelSource


class PendingOutput:
    """A step started on the ranks: `done()` without waiting, `result()` waits for it (and
    raises what the step raised)."""

    def __init__(self, output: ModelOutput) -> None:
        self.output = output

    def done(self) -> bool:
        return True

    def result(self) -> ModelOutput:
        return self.output


class Executor(abc.ABC):
    # Batches the core may have in flight at once: pipeline stages work on several (one each).
    max_concurrent_batches: int = 1

    @staticmethod
    def create(config: EngineConfig, source: ModelSource, arch: ArchConfig,
               max_model_len: int, eos_token_ids: list[int]) -> Executor:
        """The executor `config.parallel` asks for, its workers started and the model loaded."""
        backend = config.parallel.executor_backend
        if backend == "uniproc":
            from octavo.executor.uniproc import UniprocExecutor
            return UniprocExecutor(config, source, arch, max_model_len, eos_token_ids)
        if backend == "mp":
            from octavo.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor(config, source, arch, max_model_len, eos_token_ids)
        if backend == "ray":
            from octavo.executor.ray_executor import RayExecutor
            return RayExecutor(config, source, arch, max_model_len, eos_token_ids)
        raise ValueError(f"distributed_executor_backend {backend!r}: not an executor")

    @abc.abstractmethod
    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        """Allocate the KV cache within `kv_cache_memory` bytes (per rank); returns the number
        of blocks, the same on every rank."""

    @abc.abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        """Run one step on every rank; the output rank's result."""

    def execute_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start one step; its output when it is done. An executor that runs one batch at a
        time returns it done."""
        return PendingOutput(self.execute(scheduler_output))

    def kv_bytes_per_block(self, block_size: int) -> int | None:
        """Bytes of one KV block over all layers, on the rank that needs the most (None:
        unknown; the core then takes the default budget)."""
        return None

    def available_memory(self) -> int | None:
        """Bytes the KV cache could take now, the weights loaded, on the rank with the least
        (None: the system does not say)."""
        return None

    def describe(self) -> str:
        """What was loaded, for the ready line of a start (architecture, dtype, kernels)."""
        return ""

    def do_idle_work(self) -> bool:
        """A few milliseconds of deferred set-up, while the engine has no request; whether any
        is left. The engine calls it only when idle, so no step waits on it."""
        return False

    def check_health(self) -> None:
        """Raise a RuntimeError naming the worker if one is dead or failed (an executor whose
        workers live in this process is always healthy)."""

    def shutdown(self) -> None:
        """Stop the workers; returns within seconds whatever state they are in."""


def blocks_in_budget(kv_cache_memory: int, ranks: list[tuple[int, int]]) -> int:
    """The KV blocks that fit in `kv_cache_memory` on every rank, given each rank's (bytes of
    one block, bytes of its linear-attention states). A rank that caches no KV (a pipeline stage
    of linear-attention layers alone) bounds nothing; 0 when no rank caches any (an encoder)."""
    counts = []
    for block, states in ranks:
        if states > kv_cache_memory:
            raise ValueError(f"kv_cache_memory ({kv_cache_memory} bytes) is smaller than the "
                             f"linear-attention states ({states} bytes, one per max_num_seqs "
                             f"and per state_checkpoints: fewer need less)")
        if block:
            counts.append((kv_cache_memory - states) // block)
    if counts and min(counts) < 1:
        block, states = max(ranks)
        held = f", {states} of them for linear-attention states" if states else ""
        raise ValueError(f"kv_cache_memory ({kv_cache_memory} bytes{held}) is smaller than one "
                         f"block ({block} bytes on the largest rank)")
    return min(counts, default=0)
