"""Each tensor-parallel rank holds its share of the weights: built in this process as rank r of
2 (the placement set by hand: loading needs no collective), its parameter and packed bytes are
within 10% of half the model's plus what every rank replicates (norms, MoE routers)."""
from __future__ import annotations

import pytest
import torch

from octavo.arch_config import read_arch_config
from octavo.distributed import parallel_state
from octavo.distributed.parallel_state import RankPlacement
from octavo.model.loader import load_model
from octavo.model_source import resolve_model
from tests.parity.test_tiny_models import _build


def _bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of all weights, bytes of the weights every rank holds whole)."""
    total = replicated = 0
    seen: set[int] = set()
    for name, module in model.named_modules():
        tensors = [p for p in module.parameters(recurse=False)]
        weights = getattr(module, "weights", None)  # linear layers', the LM head's
        if weights is not None:
            tensors += list(weights.tensors().values())
        for t in tensors:
            if id(t) in seen:
                continue
            seen.add(id(t))
            n = t.numel() * t.element_size()
            total += n
            if t.dim() == 1 or name.endswith(".gate"):  # norms, biases, routers
                replicated += n
    return total, replicated


def _load(folder, rank: int | None, quantization: str | None, monkeypatch):
    if rank is not None:
        monkeypatch.setattr(parallel_state, "_placement", RankPlacement(rank, tp_size=2))
    try:
        source = resolve_model(str(folder))
        return load_model(source, read_arch_config(source), torch.float32, torch.device("cpu"),
                          256, quantization=quantization, pack_gemm=False)
    finally:
        monkeypatch.setattr(parallel_state, "_placement", RankPlacement(0))


@pytest.mark.parametrize("name,quantization", [("llama-default", None), ("llama-default", "int4"),
                                                ("qwen3-moe", None), ("gemma3", "int8")])
def test_each_rank_holds_half_of_the_split_weights(tmp_path, smollm_oracle_folder, monkeypatch,
                                                   name, quantization):
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    whole, whole_replicated = _bytes(_load(folder, None, quantization, monkeypatch))
    for rank in (0, 1):
        total, replicated = _bytes(_load(folder, rank, quantization, monkeypatch))
        share = (whole - whole_replicated) / 2 + replicated
        assert abs(total - share) <= 0.1 * share, (rank, total, share, whole)
