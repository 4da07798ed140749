"""The fused decode stack (one C++ call for all decoder layers of a decode step) against the
Python layers it replaces, on tiny random models: dense weights and int4/int8 low-bit copies,
q/k norms (Qwen3) and qkv biases (Qwen2), Gemma 2 and 3 (sandwich norms of 1 + w, GeGLU,
softcaps, sliding windows shorter than the prompts, local RoPE tables), mixtures of experts
(DeepSeek's latent attention and grouped routing, Llama 4's chunked attention and weighted
inputs too) and the real Gemma 3 270M; and the models and steps it must leave alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from octavo import LLM, SamplingParams
from octavo.kernels import fused as fused_kernels
from octavo.kernels.onednn import bf16_packing_available
from octavo.model import decode_stack
from octavo.model.quant.decode_weights import make_decode_weight
from octavo.model.quant.microscaled import MicroscaledPacked
from octavo.model.quant.weights import DenseWeights
from tests.model.test_microscaled import mxfp4_gpt_oss
from tests.parity.test_tiny_models import _build

pytestmark = pytest.mark.usefixtures("native_kernels")

PROMPTS = [[100 + 7 * i + j for j in range(20 + 9 * i)] for i in range(3)]


def _model(llm: LLM):
    return llm.engine.client.core.executor.worker.runner.model


def _generate(llm: LLM) -> list:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["llama-default", "qwen2-bias", "qwen3-qk-norm",
                                  "phi3-longrope-partial"])
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
    assert decode_stack.attach(model) is not None
    # Every step: the prompts' prefill too (the kernel takes them).
    _stack_then_layers(llm, bf16=True, min_calls=12)


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

    def spy(x, plans, ctx):
        ok = usable(x, plans, ctx)
        seen.append((bool(plans[0].groups), ok))
        return ok

    stack.usable = spy
    outs = _generate(llm)
    assert any(has_prefill for has_prefill, _ in seen)
    assert all(not ok for has_prefill, ok in seen if has_prefill)
    assert any(ok for _, ok in seen)
    stack.usable = usable
    model.model.decode_stack = None
    assert [o.token_ids for o in _generate(llm)] == [o.token_ids for o in outs]


def test_models_the_stack_does_not_fit_keep_their_layers(tmp_path, smollm_oracle_folder,
                                                         monkeypatch):
    """A gated activation the stack does not compute (relu on [gate | up]) keeps the layers."""
    from tests.parity import test_tiny_models

    monkeypatch.setitem(test_tiny_models.CASES, "llama-gated-relu",
                        ("LlamaConfig", "LlamaForCausalLM", {"hidden_act": "relu"}))
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-gated-relu")
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)
    model = _model(llm)
    assert getattr(model.model, "decode_stack", None) is None
    assert "activation" in decode_stack.unsupported_reason(model.model.layers)


def test_enforce_eager_turns_the_stack_off(tmp_path, smollm_oracle_folder):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enforce_eager=True)
    assert _model(llm).model.decode_stack is None
    with pytest.raises(ValueError, match="enforce_eager"):
        LLM(str(folder), enforce_eager="yes")


@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_packed_only_gguf_layers_run_in_the_stack(smollm_gguf, mode, monkeypatch):
    """--quantization int4/int8 on a GGUF leaves packed weights alone (no dense copy): the stack
    computes them too, with their kernels up to the rows they take and dequantized tiles above
    (a prompt longer than those rows, prefilled by the stack), as the Python layers do."""
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)
    llm = LLM(str(smollm_gguf), quantization=mode, max_model_len=512, kv_cache_memory=32 << 20,
              enable_prefix_caching=False)
    model = _model(llm)
    stack = model.model.decode_stack
    assert stack is not None and stack.max_tokens is None
    packed = model.model.layers[0].mlp.down_proj.weights.packed
    # Where the float32 panel takes every batch (fused.panel_ready) there are no tiles: a batch
    # past 64 rows still takes the panel, in the stack and in the layers.
    limit = min(packed.dense_rows, 64)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 12
    prompts = ["The capital of France is", "def add(a, b):", long_prompt]
    assert len(llm.tokenizer.encode(long_prompt)) > limit
    rows = []
    forward = decode_stack.DecodeStack.__call__

    def spy(self, x, *args):
        rows.append(x.shape[0])
        return forward(self, x, *args)

    monkeypatch.setattr(decode_stack.DecodeStack, "__call__", spy)
    fused_out = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    assert max(rows) > limit and min(rows) <= limit
    model.model.decode_stack = None
    layered = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    for a, b in zip(fused_out, layered):
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob)
                   for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids)) < 2e-2


@pytest.mark.parametrize("name, dtype, quantization", [
    ("mixtral", "float32", None), ("qwen2-moe", "float32", None), ("qwen3-moe", "float32", None),
    ("qwen3-moe-unnormalized", "float32", None), ("qwen2-moe", "bfloat16", None),
    ("qwen3-moe", "bfloat16", None), ("mixtral", "float32", "int4"),
    ("qwen2-moe", "bfloat16", "int8")])
def test_moe_layers_run_in_the_stack(tmp_path, smollm_oracle_folder, name, dtype, quantization):
    """Mixtures of experts (top-k with and without renormalization, Qwen2-MoE's shared expert
    and dense layer, sparse steps; dense, int4 and int8 experts) take the stack in every step,
    with the Python layers' tokens and log-probabilities: the same ops in the same order."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, quantization=quantization)
    specs = _stack_then_layers(llm, dtype == "bfloat16")
    moe = next(spec.moe for spec in specs if spec.moe is not None)
    # Quantized experts are Linears of packed weights; dense float32 ones slices of the stacked
    # weights; dense bf16 ones Linears of their own where oneDNN packs them.
    stacked = quantization is None and not (dtype == "bfloat16" and bf16_packing_available())
    assert isinstance(moe.experts[0][0], torch.Tensor) == stacked


def test_bf16_experts_are_packed_with_the_same_outputs(tmp_path, smollm_oracle_folder,
                                                       monkeypatch):
    """Dense bf16 experts become a Linear per expert and projection, whose weights oneDNN packs
    as any dense layer's: the same tokens and log-probabilities as the stacked weights'."""
    from octavo.model.layers import moe as moe_layers

    if not bf16_packing_available():
        pytest.skip("this CPU's oneDNN does not pack bf16 weights (no AVX-512)")
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    outs = []
    for split in (True, False):
        if not split:
            monkeypatch.setattr(moe_layers.onednn, "packable", lambda weight: False)
        llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, kv_cache_memory=16 << 20,
                  enable_prefix_caching=False)
        mixtures = [m for m in _model(llm).modules() if isinstance(m, moe_layers.FusedMoE)]
        outs.append(_generate(llm))
        held = [lin.weights.weight for m in mixtures if m.expert_linears is not None
                for pair in m.expert_linears for lin in pair]
        assert bool(held) == split and all(w.is_mkldnn for w in held)
        assert split or all(hasattr(m, "w13") for m in mixtures)
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        assert [x[t].logprob for x, t in zip(a.logprobs, a.token_ids)] == \
            [y[t].logprob for y, t in zip(b.logprobs, b.token_ids)]


@pytest.mark.parametrize("name, dtype", [("llama-default", "bfloat16"), ("qwen3-moe", "float32"),
                                         ("qwen2-bias", "bfloat16")])
def test_fp8_weights_run_in_the_stack(tmp_path, smollm_oracle_folder, name, dtype):
    """FP8 weights (e4m3 bytes, a float32 scale per row: --quantization fp8, as an FP8
    checkpoint keeps them), dense layers and experts, take the stack in every step: the GEMV for
    decode and, for bf16's prompts of 20-38 tokens, the tiles; the Python layers' tokens and
    log-probabilities."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, quantization="fp8")
    specs = _stack_then_layers(llm, dtype == "bfloat16")
    assert isinstance(specs[0].qkv.weights.packed, MicroscaledPacked)


def test_mxfp4_experts_run_in_the_stack(tmp_path, smollm_oracle_folder):
    """gpt-oss's MXFP4 experts (e2m1 codes, e8m0 scale bytes) take the stack in every step, the
    prompts' 20-38 rows through the tiles, with the Python layers' tokens and log-probabilities."""
    folder, _ = mxfp4_gpt_oss(tmp_path, smollm_oracle_folder)
    llm = LLM(str(folder), dtype="bfloat16", max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False)
    specs = _stack_then_layers(llm, bf16=True)
    expert = specs[0].moe.experts[0][0]
    assert isinstance(expert.weights.packed, MicroscaledPacked) and expert.weights.packed.bits == 4


@pytest.mark.parametrize("name, dtype, quantization, kv_cache_dtype", [
    ("deepseek-v3", "float32", None, "auto"), ("deepseek-v2", "bfloat16", "int4", "auto"),
    ("deepseek-v3", "float32", "int8", "fp8"), ("deepseek-v3", "bfloat16", "fp8", "auto")])
def test_latent_attention_and_grouped_routing_run_in_the_stack(
        tmp_path, smollm_oracle_folder, name, dtype, quantization, kv_cache_dtype):
    """DeepSeek's layers take the stack in every step: the latent attention (V3's compressed
    query, V2's plain one; an fp8 cache of latent rows) and the routing (V3's sigmoid scores
    chosen with a correction bias within the best expert group, scaled and renormalized; V2's
    softmax within the best group), an ungated shared expert, a dense first layer, dense, int4,
    int8 and FP8 weights: the Python layers' tokens and log-probabilities."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    cache = llm.engine.client.core.executor.worker.runner.kv_caches[0]
    assert (cache.dtype == torch.float8_e4m3fn) == (kv_cache_dtype == "fp8")  # vLLM's name
    specs = _stack_then_layers(llm, dtype == "bfloat16")
    assert all(spec.latent is not None for spec in specs)
    routing = next(spec.moe for spec in specs if spec.moe is not None).routing
    assert routing.groups == 2 and routing.scoring == ("sigmoid" if name == "deepseek-v3"
                                                       else "softmax")


@pytest.mark.parametrize("dtype, quantization", [("float32", None), ("bfloat16", "int4")])
def test_llama4_layers_run_in_the_stack(tmp_path, smollm_oracle_folder, dtype, quantization):
    """Llama 4's layers take the stack in every step: chunked local attention (the 38-token
    prompt decodes past its 48-token chunk: the chunked plan), weightless q/k norms, a layer
    without RoPE whose queries take the position's temperature, experts whose inputs the
    sigmoid routing weights scale beside an ungated shared expert; the Python layers' tokens
    and log-probabilities."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama4")
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, quantization=quantization)
    specs = _stack_then_layers(llm, dtype == "bfloat16")
    assert [spec.attention.chunk for spec in specs] == [48, None]
    assert specs[0].moe.fused.weigh_inputs and specs[0].moe.routing.choose_by == "logits"


@pytest.mark.parametrize("name, dtype, quantization", [
    ("gpt-neox-parallel", "float32", None), ("gpt-neox-sequential", "float32", None),
    ("gpt2", "float32", None), ("gpt-neox-parallel", "bfloat16", None),
    ("gpt2", "bfloat16", None), ("gpt-neox-parallel", "float32", "int8"),
    ("gpt2", "float32", "int4")])
def test_layernorm_families_run_in_the_stack(tmp_path, smollm_oracle_folder, name, dtype,
                                             quantization):
    """GPT-NeoX (LayerNorm, partial rotary, parallel or sequential residual, a plain GELU MLP,
    biases on every projection) and GPT-2 (no rotary: learned positions before the layers)
    take the stack in every step, with the Python layers' tokens and log-probabilities."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, quantization=quantization)
    specs = _stack_then_layers(llm, dtype == "bfloat16")
    assert {spec.norm_kind for spec in specs} == {decode_stack.NormKind.LAYER}


def _stack_then_layers(llm: LLM, bf16: bool, min_calls: int = 11) -> list:
    """Generate through the stack (which must run every step), then through the Python layers:
    the same tokens, and log-probabilities within bf16's rounding (float32: the same ops in the
    same order). Returns the stack's layer specs."""
    model = _model(llm)
    stack = model.model.decode_stack
    assert stack is not None, decode_stack.unsupported_reason(model.model.layers)
    with _Counted(stack) as calls:
        fused = _generate(llm)
    assert calls[0] >= min_calls  # every decode step at least
    model.model.decode_stack = None
    layered = _generate(llm)
    for a, b in zip(fused, layered):
        assert a.token_ids == b.token_ids
        diff = max(abs(x[t].logprob - y[t].logprob)
                   for x, y, t in zip(a.logprobs, b.logprobs, a.token_ids))
        assert diff < (2e-2 if bf16 else 1e-4), diff
    return stack.specs


@pytest.mark.parametrize("name, dtype", [("llama-default", "float32"), ("gemma3", "float32"),
                                         ("llama-default", "bfloat16")])
def test_an_fp8_kv_cache_runs_in_the_stack(tmp_path, smollm_oracle_folder, name, dtype):
    """An fp8 KV cache with a checkpoint's k/v scales (here set by hand, as an fp8 checkpoint
    sets them): the stack writes the same bytes as fused.write_kv and folds the scales in as
    paged_attention does."""
    from octavo.model.layers.attention import PagedAttention

    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, kv_cache_dtype="fp8_e4m3")
    model = _model(llm)
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.k_scale, module.v_scale = 0.05, 0.02  # values past 448 * scale saturate
    model.model.decode_stack.rebuild()
    _stack_then_layers(llm, dtype == "bfloat16", min_calls=12)


class _Counted:
    """The stack's __call__ wrapped on its class (instances look special methods up there)."""

    def __init__(self, stack):
        self.cls, self.calls = stack.__class__, [0]
        self.forward = self.cls.__call__

    def __enter__(self):
        forward, calls = self.forward, self.calls

        def counted(this, *args):
            calls[0] += 1
            return forward(this, *args)

        self.cls.__call__ = counted
        return self.calls

    def __exit__(self, *exc):
        self.cls.__call__ = self.forward


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "gemma3-scaled-global-rope",
                                  "mistral-sliding-window"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_windowed_and_gemma_layers_run_in_the_stack(tmp_path, smollm_oracle_folder, name, dtype):
    """Gemma's layers (and Mistral's windowed ones) take the stack in every decode step, with
    the tokens and log-probabilities of the Python layers: windows of 32 behind prompts of up
    to 38 tokens and 12 generated, so a layer reading the wrong plan or rotary table shows."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False)
    specs = _stack_then_layers(llm, dtype == "bfloat16")
    if name.startswith("gemma"):
        kinds = {spec.window is not None for spec in specs}
        assert kinds == {True, False}  # local and global layers both in the stack


@pytest.mark.parametrize("name", ["llama-biases", "granite", "olmo2", "starcoder2", "cohere",
                                  "cohere-qk-norm", "glm4", "gpt-oss"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_llama_variant_layers_run_in_the_stack(tmp_path, smollm_oracle_folder, name, dtype):
    """The families built on Llama's classes take the stack in every step, with the Python
    layers' tokens and log-probabilities: o and MLP biases, Granite's residual and attention
    scales, OLMo 2's norms after the sublayers only and q/k norms over all heads, StarCoder 2's
    LayerNorms and window, Cohere's bias-free LayerNorm over a parallel block (and Command R+'s
    LayerNorms of q and k with a weight per head), GLM-4's
    reordered pairwise rotary on half of each head and sandwich norms, gpt-oss's attention
    sinks, experts with biases and clamped SwiGLU."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False)
    _stack_then_layers(llm, dtype == "bfloat16")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gemma3_270m_gguf_decodes_alike_with_and_without_the_stack(dtype):
    """The real Gemma 3 270M (window 512: 5 local layers to 1 global), 32 greedy tokens. In
    float32 the stack computes what the Python layers compute, token for token. In bf16 they
    round differently (a short prompt's attention runs in the stack's bf16 kernel, in the
    layers through SDPA), and both are that far from float32 (measured on an AMD EPYC with
    AVX-512: mean logprob error 0.021 stack, 0.022 layers): the tokens agree by the catalog's
    criterion (tests/parity/greedy.py)."""
    from octavo.model_source import pull
    from tests.parity.greedy import check

    path = pull("gemma3-270m")
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=5)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    outs = []
    for eager in (False, True):
        llm = LLM(str(path), dtype=dtype, max_model_len=512, kv_cache_memory=64 << 20,
                  enable_prefix_caching=False, enforce_eager=eager)
        stack = _model(llm).model.decode_stack
        assert (stack is None) == eager
        if eager:
            outs.append(llm.generate(prompts, params, use_tqdm=False))
        else:
            with _Counted(stack) as calls:
                outs.append(llm.generate(prompts, params, use_tqdm=False))
            assert calls[0] >= 31
        llm.engine.shutdown()
    fused, layered = ([o.outputs[0] for o in out] for out in outs)
    if dtype == "float32":
        assert [o.token_ids for o in fused] == [o.token_ids for o in layered]
    else:
        check(outs[0], [(o.token_ids, [list(p) for p in o.logprobs], None) for o in layered])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_and_mul_kernel_matches_torch(dtype):
    native = fused_kernels.native_module()
    torch.manual_seed(0)
    # widths around the 8-lane loop; gates from -100 (gelu below 1e-33) to 10
    for width in (1, 7, 8, 19, 64, 2048):
        x = (torch.randn(5, 2 * width) * 4).to(dtype)
        x[0, :width] = torch.linspace(-100, 10, width).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        want = F.gelu(gate, approximate="tanh") * up
        got = native.gelu_tanh_and_mul(x)
        # atol: torch's 0.5 g (1 + tanh(u)) cancels to 0 (or a float ulp of 1) below about
        # g = -4, where the kernel's g / (1 + e^-2u) keeps gelu's tail (under 1e-6 times up).
        # bf16: gelu rounded to bf16 before the product, as torch does: an ulp at most.
        rtol = 2e-6 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=2e-5)


@pytest.mark.parametrize("eager", [False, True])
def test_the_kernels_are_dispatcher_ops_the_profiler_names(tmp_path, smollm_oracle_folder,
                                                           eager):
    """The C++ kernels are registered with torch's dispatcher (TORCH_LIBRARY): the Python layers
    call them as torch.ops.octavo.*, and the stack's forward and its kernels are named too."""
    from torch.profiler import ProfilerActivity, profile

    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              enforce_eager=eager)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(PROMPTS[:1], params, use_tqdm=False)
    names = {event.key for event in prof.key_averages()}
    if eager:
        assert {"octavo::rms_norm", "octavo::silu_and_mul", "octavo::decode_attention",
                "octavo::write_kv"} <= names
        assert "octavo::DecodeStack.forward" not in names
    else:
        assert {"octavo::DecodeStack.forward", "octavo::decode_attention",
                "octavo::rope_write_kv"} <= names
    assert isinstance(fused_kernels.native_module().rms_norm, torch._ops.OpOverload)
    assert torch.ops.octavo.rms_norm.default is fused_kernels.native_module().rms_norm


def test_the_stack_names_its_kinds_and_refuses_unknown_ones():
    """Norm and low-bit weight kinds, activations and plans travel by name; a name the C++ side
    does not know, or a layer given out of order or incomplete, is a clear error, not a
    silently different kernel."""
    native = fused_kernels.native_module()
    stack = native.DecodeStack(2, 1, 16, 1e-6)
    norms = [torch.ones(32), None, torch.ones(32), None, None, None]
    dense = [torch.zeros(48, 32), torch.zeros(32, 32), torch.zeros(64, 32), torch.zeros(32, 32)]
    cache, cos, sin = torch.zeros(2, 4, 16, 1, 16), torch.ones(64, 8), torch.zeros(64, 8)

    def linears(kind="none", lora_a=None, low=(None, None)):
        stack.set_linears(dense, [None] * 4, [kind] * 4, [low[0]] * 4, [low[1]] * 4,
                          [None] * 4, [None] * 4, [48, 32, 64, 32], [0] * 4, [lora_a] * 4,
                          [None] * 4, [None] * 4, [[0, 0]] * 4)

    with pytest.raises(RuntimeError, match="add_layer comes first"):
        stack.set_norms("rms", norms, [None] * 4, False, "head", 1.0)
    with pytest.raises(RuntimeError, match=r"unknown attention plan 'global' \(step, sliding, chunked\)"):
        stack.add_layer(cache, cos, sin, 0.25, 0.0, "global", 1.0, 1.0, None)
    with pytest.raises(RuntimeError, match="rotary tables must be"):
        stack.add_layer(cache, torch.ones(64, 16), torch.zeros(64, 16), 0.25, 0.0, "step", 1.0,
                        1.0, None)
    with pytest.raises(RuntimeError, match="sinks must be float32"):
        stack.add_layer(cache, cos, sin, 0.25, 0.0, "step", 1.0, 1.0, torch.zeros(3))
    stack.add_layer(cache, cos, sin, 0.25, 0.0, "step", 1.0, 1.0, None)
    with pytest.raises(RuntimeError, match="unknown norm kind 'batch'"):
        stack.set_norms("batch", norms, [None] * 4, False, "head", 1.0)
    with pytest.raises(RuntimeError, match="a bias comes with a LayerNorm's weight"):
        stack.set_norms("rms", norms, [torch.zeros(32), None, None, None], False, "head", 1.0)
    with pytest.raises(RuntimeError, match="q/k norm weights span a head"):
        stack.set_norms("rms", norms[:4] + [torch.ones(32), torch.ones(16)], [None] * 4, False,
                        "head", 1.0)
    with pytest.raises(RuntimeError, match=r"unknown q/k norm 'per_token' \(head, whole, head_"):
        stack.set_norms("rms", norms, [None] * 4, False, "per_token", 1.0)
    with pytest.raises(RuntimeError, match="q/k norms beside LayerNorms are per-head LayerNorms"):
        stack.set_norms("layer", norms[:4] + [torch.ones(16), torch.ones(16)], [None] * 4,
                        False, "head", 1.0)
    stack.set_norms("rms", norms, [None] * 4, False, "head", 1.0)
    with pytest.raises(RuntimeError, match="unknown low-bit weight kind 'int3'"):
        linears("int3")
    with pytest.raises(RuntimeError, match="a low-bit weight needs its tensors"):
        linears("int8")
    with pytest.raises(RuntimeError, match="a microscaled weight comes with its codes' and its"):
        linears("microscaled", low=(torch.zeros(48, 32, dtype=torch.uint8), torch.ones(48, 1)))
    with pytest.raises(RuntimeError, match="LoRA slots come as A, B and their use"):
        linears(lora_a=torch.zeros(1, 4, 32))
    linears()
    with pytest.raises(RuntimeError, match="unknown activation 'swish'"):
        stack.set_mlp("swish", True, "none", 0, 0, None, [])
    with pytest.raises(RuntimeError, match="a gated MLP takes silu, gelu_tanh or clamped"):
        stack.set_mlp("relu", True, "none", 0, 0, None, [])
    with pytest.raises(RuntimeError, match="the clamped SwiGLU takes alpha and limit"):
        stack.set_mlp("clamped_swiglu", True, "none", 0, 0, None, [])
    x = torch.zeros(1, 32)  # the layer is still open (no MLP): a forward is refused
    plan = (torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long),
            torch.ones(1, dtype=torch.long), 0)
    with pytest.raises(RuntimeError, match="a layer is not complete"):
        stack.forward(x, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                      [plan], None, [], None, None, None, None)
    with pytest.raises(RuntimeError, match="a dense MLP has two projections"):
        stack.set_mlp("silu", True, "gated", 0, 0, None, [])
    with pytest.raises(RuntimeError, match="scoring: softmax or sigmoid"):
        stack.set_routing(2, True, False, "tanh", "scores", 1.0, 1, 1, "max", None)
    with pytest.raises(RuntimeError, match="keep_groups in"):
        stack.set_routing(2, True, False, "softmax", "scores", 1.0, 2, 3, "max", None)
    with pytest.raises(RuntimeError, match="the latent attention's linears come first"):
        stack.set_latent(None, torch.ones(8), 1e-6, 1e-6, torch.zeros(4, 8), 2, 8, 2)
    stack.set_mlp("silu", True, "none", 0, 0, None, [])
    out = stack.forward(x, torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                        [plan], None, [], None, None, None, None)
    assert out.shape == (1, 32)
    # A layer without a KV cache is a linear attention's, which needs its description.
    stack.add_layer(None, None, None, 1.0, 0.0, "step", 1.0, 1.0, None)
    stack.set_norms("rms", norms, [None] * 4, False, "head", 1.0)
    linears()
    with pytest.raises(RuntimeError, match="the linear attention's linears come first"):
        stack.set_delta_net(False, torch.zeros(40, 4), torch.zeros(2), torch.zeros(2),
                            torch.ones(8), 1e-6, 1, 2, 8, 8, 64, torch.zeros(2, 40, 3),
                            torch.zeros(2, 2, 8, 8))
    with pytest.raises(RuntimeError, match="a layer without a KV cache computes a linear"):
        stack.set_mlp("silu", True, "none", 0, 0, None, [])


@pytest.mark.parametrize("dtype, chunked", [("float32", False), ("bfloat16", False),
                                            ("float32", True)])
def test_qwen3_next_runs_in_the_stack(tmp_path, smollm_oracle_folder, monkeypatch, dtype,
                                      chunked):
    """Qwen3-Next's linear attention layers (each request's conv window and state moved over
    its tokens: decodes batched, prompts in the chunked form) and its attention layers with
    output gates take the stack in every step, with the Python layers' tokens and
    log-probabilities; chunked: prompts in chunks of 16 tokens beside the others' decodes, and
    triangular solves of 8 tokens."""
    from octavo.model.layers import gated_delta_net
    from octavo.model.models import qwen3_next

    if chunked:
        monkeypatch.setattr(gated_delta_net, "CHUNK", 8)
        monkeypatch.setattr(qwen3_next, "CHUNK", 8)
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-next")
    llm = LLM(str(folder), dtype=dtype, max_model_len=256, kv_cache_memory=16 << 20,
              enable_prefix_caching=False, **({"max_num_batched_tokens": 16} if chunked else {}))
    specs = _stack_then_layers(llm, dtype == "bfloat16", min_calls=12)
    assert {spec.delta_net is not None for spec in specs} == {True, False}
    assert any(spec.output_gate for spec in specs)
