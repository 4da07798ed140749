"""The executor interface the core talks to. Torch-free, so the core can import it."""
from __future__ import annotations

import abc

from octavo.core.contract import ModelOutput, SchedulerOutput


class Executor(abc.ABC):
    @abc.abstractmethod
    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        """Allocate the KV cache within `kv_cache_memory` bytes; returns the number of blocks."""

    @abc.abstractmethod
    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput: ...

    def kv_bytes_per_block(self, block_size: int) -> int | None:
        """Bytes of one KV block over all layers (None: unknown; the core then takes the
        default budget)."""
        return None

    def available_memory(self) -> int | None:
        """Bytes the KV cache could take on the device now, the weights loaded (None: the
        system does not say)."""
        return None

    def describe(self) -> str:
        """What was loaded, for the ready line of a start (architecture, dtype, kernels)."""
        return ""

    def do_idle_work(self) -> bool:
        """A few milliseconds of deferred set-up, while the engine has no request; whether any
        is left. The engine calls it only when idle, so no step waits on it."""
        return False

    def shutdown(self) -> None:
        pass
