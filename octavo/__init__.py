"""octavo: an LLM inference and serving engine."""
from octavo.config import EngineConfig
from octavo.llm import LLM
from octavo.params import CompletionOutput, Logprob, RequestOutput, SamplingParams

__all__ = ["LLM", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
