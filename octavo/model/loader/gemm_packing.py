"""Dense bf16 weights packed into oneDNN's GEMM layout (kernels/onednn.py), now or in the background.

Packing SmolLM2-135M's 121 weights takes 0.13-0.18 s on 2 cores: a tenth of a server's start.
Packed and plain weights give the same products bit for bit (only the time differs), so a server
can report ready with plain weights and pack on a thread of its own: `PackingThread` does that,
and the worker puts the packed weights in place between two steps (`install_if_done`). Small
batches of a GGUF model run on its int4/int8 copies anyway, so a first short request does not
touch the dense weights at all.
"""
from __future__ import annotations

import os
import sys
import threading

import torch
from torch import nn

from octavo.kernels import onednn


def packable_modules(model: nn.Module, quantization: str | None) -> list[nn.Module]:
    """The Linear and LMHead modules whose dense weight oneDNN packs. A tied LM head would need a
    packed copy of its own (the embedding indexes the plain table): included unless
    --quantization asked for smaller weights."""
    from octavo.model.layers.embedding import LMHead
    from octavo.model.layers.linear import Linear

    found = []
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)):
            weight = getattr(module, "weight", None)
            if getattr(module, "tied", False) and quantization is not None:
                continue
            if weight is not None and onednn.packable(weight):
                found.append(module)
    return found


def install(module: nn.Module, packed: torch.Tensor) -> None:
    module.weight = nn.Parameter(packed, requires_grad=False)


def pack_now(model: nn.Module, quantization: str | None) -> None:
    for module in packable_modules(model, quantization):
        install(module, onednn.pack(module.weight.data))


class PackingThread:
    """Packs a loaded model's dense weights on a background thread. `install_if_done()` is
    called by the thread that runs the model, between steps: once the packing has finished it
    swaps every weight in and rebuilds the model's decode stack (whose C++ layers hold the
    weights they were built with)."""

    def __init__(self, model: nn.Module, quantization: str | None) -> None:
        self.model = model
        self.modules = packable_modules(model, quantization)
        self.packed: list[torch.Tensor] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._pack, name="octavo-gemm-packing",
                                       daemon=True)
        self.thread.start()

    def _pack(self) -> None:
        if sys.platform == "linux":
            # Niced (Linux nices threads one by one; the OpenMP workers this thread starts
            # inherit it): the packing takes the CPU time the engine leaves, instead of four
            # threads on two cores slowing the first requests' steps.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        try:
            self.packed = [onednn.pack(m.weight.data) for m in self.modules]
        except BaseException as exc:  # re-raised by install_if_done, in the engine's thread
            self.error = exc

    def install_if_done(self, wait: bool = False) -> bool:
        """Swap the packed weights in if they are ready (`wait`: block until they are); whether
        the model now has them."""
        if wait:
            self.thread.join()
        if self.thread.is_alive():
            return False
        if self.error is not None:
            raise RuntimeError(f"packing the GEMM weights failed: {self.error}") from self.error
        for module, packed in zip(self.modules, self.packed):
            install(module, packed)
        self.modules, self.packed = [], []
        stack = getattr(getattr(self.model, "model", None), "decode_stack", None)
        if stack is not None:
            stack.rebuild()
        return True
