"""A GPU's MoE layers compute their experts as two grouped GEMMs over device-side offsets
(moe.FusedMoE._grouped, torch._grouped_mm): the same outputs as the CPU's loop over the experts,
with and without expert biases (gpt-oss) and with the routing weights on the inputs (Llama 4)."""
from __future__ import annotations

import pytest
import torch

from octavo.model.layers import moe
from octavo.model.layers.moe import FusedMoE


@pytest.mark.parametrize("bias, weigh_inputs", [(False, False), (True, False), (False, True)])
def test_grouped_gemms_give_the_loop_s_outputs(monkeypatch, bias, weigh_inputs):
    torch.manual_seed(0)
    layer = FusedMoE(num_experts=6, top_k=2, hidden_size=32, intermediate_size=16,
                     hidden_act="silu", renormalize=True, bias=bias, weigh_inputs=weigh_inputs)
    for p in layer.parameters():
        p.data.normal_(0, 0.2)
    x, logits = torch.randn(9, 32), torch.randn(9, 6)
    logits[:, 5] = -1e4  # an expert no row is routed to: an empty group
    with torch.inference_mode():
        loop = layer.eager_forward(x, logits)
        assert not layer.grouped(x.device)
        monkeypatch.setattr(moe, "GROUPED_DEVICES", ("cpu",))
        assert not layer.grouped(x.device)  # torch's kernel would read offsets on the host
        monkeypatch.setattr(moe, "grouped_gemm_on_device", lambda device, dtype: True)
        assert layer.grouped(x.device)
        grouped = layer.eager_forward(x, logits)
    assert torch.allclose(grouped, loop, atol=1e-5)


def test_rows_torch_s_kernel_cannot_take_keep_the_loop(monkeypatch):
    monkeypatch.setattr(moe, "GROUPED_DEVICES", ("cpu",))
    monkeypatch.setattr(moe, "grouped_gemm_on_device", lambda device, dtype: True)
    odd = FusedMoE(num_experts=4, top_k=2, hidden_size=30, intermediate_size=16,
                   hidden_act="silu", renormalize=True)  # 120-byte rows: not 16-byte multiples
    assert not odd.grouped(torch.device("cpu"))

