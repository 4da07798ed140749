"""vLLM's module names for the outputs (`from octavo.outputs import RequestOutput`, as from
vllm.outputs; `BeamSearchOutput` and `BeamSearchSequence` as vllm.beam_search has them)."""
from octavo.params import (
    BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput)

__all__ = ["RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput",
           "BeamSearchSequence"]
