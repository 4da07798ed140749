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

    def shutdown(self) -> None:
        pass
