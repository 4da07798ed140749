"""Dense bf16 weights packed into oneDNN's GEMM layout (kernels/onednn.py), at load or step by step.

Packing is a step of a layer's dense weights (`DenseWeights.pack_for_onednn`, quant/weights.py):
the Linear and LMHead modules whose weights are dense take it. Packing SmolLM2-135M's 121
weights takes 0.13-0.18 s on 2 cores: a tenth of a server's start.
Packed and plain weights give the same products bit for bit (only the time differs), so the
worker reports ready with plain weights and packs a few of them at a time (`StepwisePacking`,
about 5 ms each time): while the engine has no request (the core process's loop calls
`Executor.do_idle_work`), else before each step. A server is ready sooner, and one started ahead
of its traffic is fully packed when the traffic comes (a burst of prompts on plain weights ran
its first steps slower). Small batches of a GGUF model run on its int4/int8 copies anyway, so a
first short request hardly touches the dense weights.

A thread packing beside the steps was tried first. A first one-token request that ran while it
packed took 24-170 ms instead of about 15, niced or not, and a process that exited while it
packed aborted (std::terminate in a daemon thread).
"""
from __future__ import annotations

from torch import nn

from octavo.model.layers.embedding import Embedding
from octavo.model.quant.weights import DenseWeights


def split_experts(model: nn.Module) -> None:
    """Dense bf16 experts as a Linear each, whose weights the packing then takes like any other
    (FusedMoE.split_for_packing). After the prepared-weights cache, which keeps them stacked."""
    for module in [m for m in model.modules() if hasattr(m, "split_for_packing")]:
        module.split_for_packing()


def packable_weights(model: nn.Module, quantization: str | None) -> list[DenseWeights]:
    """The dense weights oneDNN packs. A tied LM head's would be a packed copy of its own (the
    embedding indexes the plain table): included unless --quantization asked for smaller
    weights."""
    found = []
    for module in model.modules():
        weights = getattr(module, "weights", None)
        if not isinstance(weights, DenseWeights) or isinstance(module, Embedding):
            continue  # an embedding indexes its table: no GEMM reads it
        if getattr(module, "tied", False) and quantization is not None:
            continue
        if weights.packable():
            found.append(weights)
    return found


def pack_now(model: nn.Module, quantization: str | None) -> None:
    for weights in packable_weights(model, quantization):
        weights.pack_for_onednn()


class StepwisePacking:
    """Packs a loaded model's dense weights about `per_step_bytes` at a time (whole weights, at
    least one), called by the worker while the engine is idle and before each step: a step's
    share costs the same whether it is a few large matrices or many experts' small ones. Each
    packed weight goes in at once; once the last is in, the model's decode stack is rebuilt (its
    C++ layers hold the weights they were built with)."""

    def __init__(self, model: nn.Module, quantization: str | None,
                 per_step_bytes: int = 8 << 20) -> None:
        self.model = model
        self.pending = packable_weights(model, quantization)
        self.per_step_bytes = per_step_bytes

    def pack_some(self) -> bool:
        """Pack the next few weights; whether every weight is now packed."""
        count, taken = 0, 0
        while count < len(self.pending) and (count == 0 or taken < self.per_step_bytes):
            taken += self.pending[count].weight.nbytes
            count += 1
        batch, self.pending = self.pending[:count], self.pending[count:]
        for weights in batch:
            weights.pack_for_onednn()
        if self.pending:
            return False
        stack = getattr(getattr(self.model, "model", None), "decode_stack", None)
        if stack is not None:
            stack.rebuild()
        return True
