"""vLLM's module names for the request parameters (`from octavo.sampling_params import
SamplingParams`, as from vllm.sampling_params)."""
from octavo.params import (
    BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams)

__all__ = ["SamplingParams", "StructuredOutputsParams", "BeamSearchParams", "RequestOutputKind"]
