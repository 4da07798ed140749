"""octavo: an LLM inference and serving engine."""
from octavo.config import EngineConfig
from octavo.llm import LLM
from octavo.params import (
    CompletionOutput, Logprob, RequestOutput, SamplingParams, StructuredOutputsParams)

__all__ = ["LLM", "EngineConfig", "SamplingParams", "StructuredOutputsParams", "RequestOutput",
           "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
