"""Reading a PEFT adapter against a mixture-of-experts base model without loading a tensor:
expert pairs in either layout, alpha patterns, and each bad file refused naming the problem."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from octavo.arch_config import ArchConfig
from octavo.lora.adapter import AdapterError, read_adapter
from octavo.params import LoRARequest

# Qwen2-MoE-like: hidden 64, 4 experts of width 32, a shared expert of 48, layer 1 dense (128)
ARCH = ArchConfig("Qwen2MoeForCausalLM", 256, 64, 128, 2, 4, 2, 16, 256, extra={
    "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
    "mlp_only_layers": [1]})
PREFIX = "base_model.model.model.layers"


def _adapter(tmp_path, pairs: dict[str, tuple[tuple[int, int], tuple[int, int]]],
             **config) -> LoRARequest:
    tensors = {}
    for module, (a, b) in pairs.items():
        tensors[f"{PREFIX}.{module}.lora_A.weight"] = torch.zeros(a)
        tensors[f"{PREFIX}.{module}.lora_B.weight"] = torch.zeros(b)
    save_file(tensors, tmp_path / "adapter_model.safetensors")
    (tmp_path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    return LoRARequest("moe", 1, str(tmp_path))


def test_expert_pairs_in_either_layout(tmp_path):
    """Stacked pairs (told apart by their shapes, whatever their nesting) and per-expert ones
    (Qwen's and Mixtral's names), the shared expert and a dense layer's MLP."""
    request = _adapter(tmp_path, {
        "0.mlp.experts.base_layer": ((8 * 4, 64), (64, 8 * 4)),  # gate_up at rank 8
        "0.mlp.experts": ((4 * 4, 32), (64, 4 * 4)),  # down
        "0.mlp.shared_expert.up_proj": ((4, 64), (48, 4)),
        "1.mlp.gate_proj": ((4, 64), (128, 4)),
        "1.block_sparse_moe.experts.3.w2": ((4, 32), (64, 4)),
    }, alpha_pattern={r".*\.gate_up_proj": 16})
    with pytest.raises(AdapterError, match="layers.1.block_sparse_moe.experts.3.w2"):
        read_adapter(request, ARCH, 8)  # layer 1 is dense
    request = _adapter(tmp_path, {
        "0.mlp.experts.base_layer": ((8 * 4, 64), (64, 8 * 4)),
        "0.mlp.experts": ((4 * 4, 32), (64, 4 * 4)),
        "0.mlp.shared_expert.up_proj": ((4, 64), (48, 4)),
        "1.mlp.gate_proj": ((4, 64), (128, 4)),
        "0.block_sparse_moe.experts.3.w2": ((4, 32), (64, 4)),
    }, alpha_pattern={r".*\.gate_up_proj": 16})
    spec = read_adapter(request, ARCH, 8)
    got = {t.module: (t.rank, t.scaling, t.experts) for t in spec.targets}
    assert got == {
        "model.layers.0.mlp.experts.gate_up_proj": (8, 2.0, 4),
        "model.layers.0.mlp.experts.down_proj": (4, 2.0, 4),
        "model.layers.0.mlp.shared_expert.up_proj": (4, 2.0, 0),
        "model.layers.1.mlp.gate_proj": (4, 2.0, 0),
        "model.layers.0.block_sparse_moe.experts.3.w2": (4, 2.0, 0),
    }


BAD = {
    "rows": ({"0.mlp.experts": ((4 * 4 + 1, 32), (64, 4 * 4 + 1))}, {},
             "not a rank for each of 4 experts"),
    "stacked-shape": ({"0.mlp.experts": ((4 * 4, 48), (64, 4 * 4))}, {}, "no module"),
    "expert": ({"0.mlp.experts.4.gate_proj": ((4, 64), (32, 4))}, {}, "no module"),
    "twice": ({"0.mlp.experts": ((4 * 4, 32), (64, 4 * 4)),
               "0.mlp.experts.base_layer": ((4 * 4, 32), (64, 4 * 4))}, {}, "two LoRA pairs"),
    "rank": ({"0.mlp.experts.base_layer": ((16 * 4, 64), (64, 16 * 4))}, {},
             "rank 16, above --max-lora-rank 8"),
    "pattern": ({"0.mlp.experts.1.up_proj": ((4, 64), (32, 4))}, {"alpha_pattern": {"(": 2}},
                "not a regular expression"),
    "alpha": ({"0.mlp.experts.1.up_proj": ((4, 64), (32, 4))}, {"alpha_pattern": {"up": 0}},
              "must be a positive number"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_expert_adapters_are_refused(tmp_path, case):
    pairs, config, message = BAD[case]
    with pytest.raises(AdapterError, match=message) as info:
        read_adapter(_adapter(tmp_path, pairs, **config), ARCH, 8)
    assert "'moe'" in str(info.value)
