"""How the offline front end reaches the engine core: in the caller's process (LLM and tests).

This module and core_process.py are the core's two hosts, the only front-end modules that
build a core (`create_engine_core`, the core's entry point); everything else in the front end
sees the core only through the protocol's messages (octavo/core/protocol.py), which pass here
as they are, without encoding.
"""
from __future__ import annotations

from collections.abc import Callable

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.engine_core import create_engine_core
from octavo.core.protocol import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from octavo.engine.grammar import XgrammarBackend
from octavo.model_source import ModelSource


class InprocClient:
    """The core runs in the caller's process; `step` runs one engine step."""

    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int],
                 grammar_backend: Callable[[], XgrammarBackend] | None = None) -> None:
        if config.parallel.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1: the replicas run in core processes "
                             "(replica_client.py), not in this one")
        self.core = create_engine_core(config, source, arch, max_model_len, eos_token_ids,
                                       grammar_backend)

    @property
    def max_model_len(self) -> int:
        """The context the core settled on (shorter than asked when its KV cache is)."""
        return self.core.max_model_len

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, req_ids: list[str]) -> None:
        self.core.abort_requests(req_ids)

    def step(self) -> list[EngineCoreOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def shutdown(self) -> None:
        self.core.shutdown()
