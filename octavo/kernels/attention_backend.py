"""Which attention computes a step over the paged KV cache, chosen once at start
(`--attention-backend`, with vLLM's names; `auto` by device).

- `CPU_ATTN` (auto on the CPU): octavo's C++ kernel reads each query's keys in place from its
  blocks (decodes, verification, prompts: paged_attention.build_plan's `native_decode`), and the
  padded SDPA groups take what it does not. Kernels still being built in the background take
  over once they are loaded, so whether they do is asked at each step.
- `TORCH_SDPA` (auto on a GPU, and anywhere by choice): every query in padded
  `scaled_dot_product_attention` / matmul groups over keys gathered through the block tables,
  torch ops alone. On the CPU it is the reference the kernel is tested against.
- FlashAttention, FlashInfer, FlexAttention and Triton backends are not built yet: asking for
  one is refused by name (config.DeviceConfig checks the name).
The KV cache's layout, the plans and the slot-mapped writes are the same for all of them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.kernels import fused


@dataclass(frozen=True)
class AttentionBackend:
    name: str

    @classmethod
    def select(cls, name: str, device: torch.device) -> AttentionBackend:
        if name == "AUTO":
            name = "CPU_ATTN" if device.type == "cpu" else "TORCH_SDPA"
        return cls(name)

    def kernel_takes_queries(self) -> bool:
        """Whether this step's short queries go to the C++ kernel."""
        return self.name == "CPU_ATTN" and fused.native_ready()

    def describe(self) -> str:
        return {"CPU_ATTN": "octavo's C++ kernel reading the paged cache in place (padded SDPA "
                            "for what it does not take)",
                "TORCH_SDPA": "torch SDPA over keys gathered through the block tables"}[self.name]


CPU_ATTN = AttentionBackend("CPU_ATTN")
