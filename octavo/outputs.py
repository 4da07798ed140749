"""vLLM's module names for the outputs (`from octavo.outputs import RequestOutput`, as from
vllm.outputs; `BeamSearchOutput` and `BeamSearchSequence` as vllm.beam_search has them; the
pooling outputs of `LLM.encode` and `LLM.embed`)."""
from octavo.params import (
    BeamSearchOutput, BeamSearchSequence, CompletionOutput, Logprob, RequestOutput)
from octavo.pooling_params import (
    EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput, PoolingRequestOutput)

__all__ = ["RequestOutput", "CompletionOutput", "Logprob", "BeamSearchOutput",
           "BeamSearchSequence", "PoolingOutput", "PoolingRequestOutput", "EmbeddingOutput",
           "EmbeddingRequestOutput"]
