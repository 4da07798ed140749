"""The fused decode stack (one C++ call for all decoder layers of a decode step) against the
Python layers it replaces, on tiny random models: dense weights and int4/int8 low-bit copies,
q/k norms (Qwen3) and qkv biases (Qwen2); and the models and steps it must leave alone."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model import decode_stack
from octavo.model.quant.decode_weights import make_decode_weight
from octavo.model.quant.packed import Int4Packed, Int8Grouped
from octavo.model.quant.weights import DenseWeights
from tests.parity.test_tiny_models import _build

pytestmark = pytest.mark.usefixtures("native_kernels")

PROMPTS = [[100 + 7 * i + j for j in range(20 + 9 * i)] for i in range(3)]


def _model(llm: LLM):
    return llm.engine.client.core.executor.worker.runner.model


def _generate(llm: LLM) -> list:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["llama-default", "qwen2-bias", "qwen3-qk-norm"])
@pytest.mark.parametrize("bits", [None, 4, 8])
def test_stack_matches_the_python_layers(tmp_path, smollm_oracle_folder, name, bits):
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    # No prefix caching: the second run must prefill the way the first did (bf16 rounding of
    # another attention path could flip a near-tie of the random model).
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False)
    model = _model(llm)
    if bits is not None:  # the low-bit copies a 4- or 8-bit GGUF would get
        for layer in model.model.layers:
            for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                        layer.mlp.gate_up_proj, layer.mlp.down_proj):
                dense = lin.weights.weight
                lin.set_weights(DenseWeights(dense, make_decode_weight(dense, bits)))
    stack = decode_stack.attach(model)
    assert stack is not None
    calls = [0]
    forward = stack.__class__.__call__

    def counted(self, *args):
        calls[0] += 1
        return forward(self, *args)

    stack.__class__.__call__ = counted
    try:
        fused = _generate(llm)
    finally:
        stack.__class__.__call__ = forward
    assert calls[0] >= 12  # every step: the prompts' prefill too (the kernel takes them)
    model.model.decode_stack = None
    layered = _generate(llm)
    for a, b in zip(fused, layered):
        assert a.token_ids == b.token_ids
        diff = max(abs(x[t].logprob - y[t].logprob)
                   for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        assert diff < 2e-2, diff  # the same kernels in the same order; bf16 rounding at most


def test_steps_with_padded_prefills_run_the_layers(tmp_path, smollm_oracle_folder,
                                                   monkeypatch):
    """A step whose attention plan has a padded SDPA group (a prefill chunk over a long context)
    runs the Python layers; steps the in-place kernel takes whole run the stack."""
    from octavo.kernels import paged_attention

    monkeypatch.setattr(paged_attention, "KERNEL_CONTEXT_LEN", 0)  # every chunk > 8 to SDPA
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=16)  # the later prompts prefill while the first decodes
    model = _model(llm)
    stack = model.model.decode_stack
    assert stack is not None
    seen = []
    usable = stack.usable

    def spy(x, plan, sliding, caches):
        ok = usable(x, plan, sliding, caches)
        seen.append((bool(plan.groups), ok))
        return ok

    stack.usable = spy
    outs = _generate(llm)
    assert any(has_prefill for has_prefill, _ in seen)
    assert all(not ok for has_prefill, ok in seen if has_prefill)
    assert any(ok for _, ok in seen)
    stack.usable = usable
    model.model.decode_stack = None
    assert [o.token_ids for o in _generate(llm)] == [o.token_ids for o in outs]


@pytest.mark.parametrize("name", ["gemma3", "phi3-longrope-partial", "mixtral",
                                  "mistral-sliding-window"])
def test_models_the_stack_does_not_fit_keep_their_layers(tmp_path, smollm_oracle_folder, name):
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    model = _model(llm)
    assert getattr(model.model, "decode_stack", None) is None


def test_enforce_eager_turns_the_stack_off(tmp_path, smollm_oracle_folder):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enforce_eager=True)
    assert _model(llm).model.decode_stack is None
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(folder), enforce_eager="yes")


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_packed_only_gguf_layers_run_in_the_stack(smollm_gguf, mode):
    """--quantization int4/int8 on a GGUF leaves packed weights alone (no dense copy): the stack
    computes them too, for steps of at most the rows their kernels take."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    llm = LLM(str(smollm_gguf), quantization=mode, max_model_len=512, kv_cache_memory=32 << 20,
              enable_prefix_caching=False)
    model = _model(llm)
    stack = model.model.decode_stack
    assert stack is not None
    prompts = ["The capital of France is", "def add(a, b):"]
    fused_out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert stack.max_tokens == (Int4Packed if mode == "int4" else Int8Grouped).dense_rows
    model.model.decode_stack = None
    layered = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(fused_out, layered):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob)
                   for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 2e-2
