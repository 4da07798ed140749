"""Weights packed for oneDNN's GEMM (octavo/kernels/onednn.py): the same products as F.linear,
bit for bit, for every row count; packed at load for bf16 models on the CPU only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo.kernels import onednn

needs_packing = pytest.mark.skipif(not onednn.bf16_packing_available(),
                                   reason="this torch or CPU packs no bf16 weights for oneDNN")


@needs_packing
@pytest.mark.parametrize("rows", [1, 3, 5, 17, 64, 300])
def test_packed_linear_is_f_linear_bit_for_bit(rows):
    torch.manual_seed(rows)
    weight = torch.randn(200, 96).bfloat16()
    bias = torch.randn(200).bfloat16()
    packed = onednn.pack(weight)
    assert packed.is_mkldnn and packed.shape == weight.shape
    x = torch.randn(rows, 96).bfloat16()
    assert torch.equal(onednn.linear(x, packed), F.linear(x, weight))
    assert torch.equal(onednn.linear(x, packed, bias), F.linear(x, weight, bias))
    x3 = torch.randn(2, rows, 96).bfloat16()  # leading dims pass through
    assert torch.equal(onednn.linear(x3, packed), F.linear(x3, weight))
    assert torch.equal(onednn.dense(packed), weight)


@needs_packing
def test_packing_rules_and_dtype_mismatch():
    assert not onednn.packable(torch.zeros(4, 4))  # float32 keeps F.linear's summation order
    assert not onednn.packable(torch.zeros(4, dtype=torch.bfloat16))
    packed = onednn.pack(torch.randn(8, 16).bfloat16())
    assert not onednn.packable(packed)
    with pytest.raises(TypeError, match="bfloat16 activations"):
        onednn.linear(torch.randn(2, 16), packed)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_cpu_model_loads_packed_in_bf16_only(tmp_path, smollm_oracle_folder, dtype):
    from octavo import LLM, SamplingParams
    from octavo.model.layers.embedding import LMHead
    from octavo.model.layers.linear import Linear
    from tests.parity.test_tiny_models import _build

    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype=dtype, max_model_len=128, kv_cache_memory=8 << 20)
    worker = llm.engine.client.core.executor.worker
    while worker.do_idle_work():  # a few weights each time (gemm_packing) until all are packed
        pass
    assert worker.packing is None and not worker.do_idle_work()
    model = worker.runner.model
    weights = [m.weights.weight for m in model.modules() if isinstance(m, (Linear, LMHead))]
    packs = dtype == "bfloat16" and onednn.bf16_packing_available()
    assert weights and all(w.is_mkldnn == packs for w in weights)
    assert not model.model.embed_tokens.weight.is_mkldnn  # the table the embedding indexes
    out = llm.generate([[5, 6, 7, 8, 9, 10]], SamplingParams(max_tokens=4, temperature=0),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@needs_packing
def test_weights_packed_step_by_step_change_no_output(tmp_path, smollm_oracle_folder):
    """The engine serves with plain weights and packs a few before each step; once the last is
    packed the C++ decode stack is rebuilt. Outputs are the same bit for bit with plain, partly
    packed and packed weights."""
    from octavo import LLM, SamplingParams
    from octavo.model.layers.linear import Linear
    from tests.parity.test_tiny_models import _build

    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=128, kv_cache_memory=8 << 20)
    worker = llm.engine.client.core.executor.worker
    model = worker.runner.model
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    prompts = [list(range(5, 45)), [7, 8, 9]]  # a prefill of 43 rows and, later, decodes
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3)

    def run():
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()}
                                          for d in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, use_tqdm=False)]

    packing, worker.packing = worker.packing, None  # held back: plain weights only
    plain = run()
    assert not any(m.weights.weight.is_mkldnn for m in linears)
    stack = model.model.decode_stack
    built_plain = stack._stack
    assert built_plain is not None  # its C++ layers hold the plain weights
    worker.packing = packing
    packing.per_step_bytes = 1  # this model has 9 weights: one before each of the next steps
    partly = run()
    packed_now = sum(m.weights.weight.is_mkldnn for m in linears)
    assert 0 < packed_now < len(linears) and worker.packing is not None
    while worker.packing is not None:
        packed = run()
    assert all(m.weights.weight.is_mkldnn for m in linears)
    assert model.lm_head.weights.weight.is_mkldnn
    assert stack._stack is not None and stack._stack is not built_plain
    assert plain == partly == packed


def test_a_cpu_whose_onednn_cannot_pack_bf16_keeps_plain_weights(monkeypatch):
    """oneDNN's bf16 reorder raises on CPUs with AVX2 only: bf16 weights then stay plain."""
    def refuse(weight):
        raise RuntimeError("mkldnn_reorder_linear_weight: bf16 path needs the cpu support ...")

    monkeypatch.setattr(onednn, "pack", refuse)
    onednn.bf16_packing_available.cache_clear()
    try:
        assert not onednn.bf16_packing_available()
        assert not onednn.packable(torch.zeros(4, 4, dtype=torch.bfloat16))
    finally:
        monkeypatch.undo()
        onednn.bf16_packing_available.cache_clear()
