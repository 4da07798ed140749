"""How the front end reaches the engine core. In-process for LLM and tests."""
from __future__ import annotations

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.core.engine_core import create_engine_core
from octavo.core.request import Request
from octavo.core.scheduler import EngineCoreOutput, SchedulerStats
from octavo.core.structured import BackendFactory
from octavo.model_source import ModelSource


class InprocClient:
    """The core runs in the caller's process; `step` runs one engine step."""

    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int],
                 grammar_backend: BackendFactory | None = None) -> None:
        self.core = create_engine_core(config, source, arch, max_model_len, eos_token_ids,
                                       grammar_backend)

    def add_request(self, request: Request) -> None:
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
