"""octavo: an LLM inference and serving engine."""
from __future__ import annotations

from typing import TYPE_CHECKING

from octavo.config import EngineConfig
from octavo.inputs import PromptType, TextPrompt, TokensPrompt
from octavo.params import (
    BeamSearchOutput, BeamSearchParams, CompletionOutput, Logprob, LoRARequest, RequestOutput,
    SamplingParams, StructuredOutputsParams)
from octavo.pooling_params import PoolingParams

if TYPE_CHECKING:
    from octavo.async_llm import AsyncLLM, AsyncLLMEngine
    from octavo.llm import LLM

__all__ = ["LLM", "EngineConfig", "SamplingParams", "PoolingParams", "BeamSearchParams",
           "StructuredOutputsParams",
           "RequestOutput", "CompletionOutput", "LoRARequest", "Logprob", "BeamSearchOutput", "PromptType",
           "TextPrompt", "TokensPrompt", "AsyncLLM", "AsyncLLMEngine"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the whole front end; the server and the engine-core process import `octavo`
    # for its small modules and should not pay for it at start-up.
    if name == "LLM":
        from octavo.llm import LLM

        return LLM
    if name in ("AsyncLLM", "AsyncLLMEngine"):
        from octavo import async_llm

        return getattr(async_llm, name)
    raise AttributeError(f"module 'octavo' has no attribute {name!r}")
