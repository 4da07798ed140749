"""One worker in this process."""
from __future__ import annotations

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.distributed.parallel_state import RankPlacement
from octavo.executor.base import Executor, blocks_in_budget
from octavo.model_source import ModelSource
from octavo.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int]) -> None:
        # A replica whose experts span the others is a rank of their world even alone.
        self.worker = Worker(config, source, arch, max_model_len, eos_token_ids,
                             RankPlacement.of(config.parallel, 0),
                             config.parallel.replica_init_method)
        self.worker.load_model()

    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        ranks = [(self.worker.kv_bytes_per_block(block_size), self.worker.state_bytes())]
        return self.worker.init_kv_cache(blocks_in_budget(kv_cache_memory, ranks), block_size)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.worker.kv_bytes_per_block(block_size)

    def available_memory(self) -> int | None:
        return self.worker.available_memory()

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        return self.worker.execute(scheduler_output)

    def describe(self) -> str:
        return self.worker.describe()

    def do_idle_work(self) -> bool:
        return self.worker.do_idle_work()
