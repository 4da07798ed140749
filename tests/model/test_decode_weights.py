"""The int4/int8 small-batch weight copies against the dense weights they stand for (the GGUF
codes they are made of: test_gguf_packed.py)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model.quant.decode_weights import (
    INT4_ROWS,
    INT4_ROWS_AMX,
    INT4_ROWS_F32,
    INT8_ROWS_F32,
    MAX_ROWS,
    make_decode_weight,
    max_rows,
)
from octavo.model.quant.packed import Int4Packed, Int8Grouped, quantize_int8
from octavo.model.quant.weights import DenseWeights, PackedWeights


def _q4_weight(n: int, k: int) -> torch.Tensor:
    """A weight that is exactly 4-bit per group of 32 (like a dequantized GGUF Q4_1 tensor)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each group spans the full range, as min/max quantizers do
    scale = (torch.rand(n, k // 32, 1, generator=g) * 0.02 + 0.001).bfloat16().float()
    low = (torch.randn(n, k // 32, 1, generator=g) * 0.05).bfloat16().float()
    return (q * scale + low).reshape(n, k).bfloat16()


def test_int4_reproduces_a_4bit_weight():
    w = _q4_weight(96, 256)
    x = torch.randn(3, 256).bfloat16()
    dense = torch.nn.functional.linear(x.float(), w.float())
    out = make_decode_weight(w, 4).matmul(x).float()
    assert (out - dense).norm() / dense.norm() < 1e-2


@pytest.mark.parametrize("native", [False, True], ids=["torch", "native"])
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
def test_int8_close_to_dense(native_kernels, native, rows):
    from octavo.kernels import fused

    fused.enable_native(native)
    w = torch.randn(64, 160).bfloat16()  # 160: the kernel's 16-wide loop plus no tail
    x = torch.randn(rows, 160).bfloat16()
    dense = torch.nn.functional.linear(x.float(), w.float())
    out = make_decode_weight(w, 8).matmul(x)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 64)
    assert (out.float() - dense).norm() / dense.norm() < 2e-2


def test_int8_kernel_matches_torch_kernel(native_kernels):
    from octavo.kernels import fused

    w, x = torch.randn(300, 96).bfloat16(), torch.randn(2, 96).bfloat16()
    weight = quantize_int8(w, torch.bfloat16)  # per channel
    ours = fused.int8_gemv(x, weight.q[0], weight.scale[0]).float()
    theirs = torch._weight_int8pack_mm(x, weight.q[0], weight.scale_dtype[0]).float()
    assert torch.allclose(ours, theirs, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 9, 20])
@pytest.mark.parametrize("n, k, group", [(200, 96, 32), (64, 576, 32), (48, 256, 128)])
def test_int4_kernel_matches_torch_kernel(native_kernels, rows, n, k, group):
    """octavo's int4 kernel (its own layout, float32 scales) against the exact product and
    against torch's kernel (bf16 scales) on the same codes; N not a multiple of 16 is padded."""
    from octavo.kernels import fused
    from octavo.model.quant.packed import Int4Packed, minmax_int4

    if not fused.int4_gemm_ready(torch.bfloat16):
        pytest.skip("octavo's int4 kernel takes bf16 activations only with AVX-512-BF16")
    g = torch.Generator().manual_seed(rows * n)
    q, scale, low = minmax_int4(torch.randn(n, k, generator=g), group)
    weight = Int4Packed.from_affine(q, scale, low, group, torch.bfloat16)
    x = torch.randn(rows, k, generator=g).bfloat16()
    ours = fused.int4_gemm(x, *weight.native_layout())[:, :n]
    packed, scales_zeros = weight.torch_layout()
    theirs = torch._weight_int4pack_mm_for_cpu(x, packed, 32, scales_zeros)[:, :n]
    assert ours.shape == (rows, n) and ours.dtype == torch.bfloat16
    exact = (q.view(n, -1, group) * scale[..., None] + low[..., None]).view(n, k)
    ref = x.float() @ exact.t()
    assert (ours.float() - ref).norm() / ref.norm() < 3e-3  # bf16 output rounding only
    assert (ours.float() - ref).norm() <= (theirs.float() - ref).norm()  # bf16 scales cost
    assert (ours.float() - theirs.float()).norm() / ref.norm() < 1e-2
    assert torch.equal(weight.kernel_matmul(x), ours)  # the Python layer takes it
    with pytest.raises(RuntimeError, match="bf16 or float32"):
        fused.int4_gemm(x.half(), *weight.native_layout())


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 32])
@pytest.mark.parametrize("group", [16, 32, 64])
def test_grouped_int8_kernel_matches_its_dequantized_weight(native_kernels, rows, group):
    """A scale per group of inputs (GGUF's Q8_0: 32), applied group by group in the GEMV."""
    from octavo.kernels import fused

    g = torch.Generator().manual_seed(group)
    q = torch.randint(-127, 128, (200, 192), generator=g, dtype=torch.int8)
    scale = torch.rand(200, 192 // group, generator=g) * 0.01 + 1e-4
    x = torch.randn(rows, 192, generator=g).bfloat16()
    w = (q.float().view(200, -1, group) * scale[..., None]).view(200, 192)
    ref = x.float() @ w.t()
    out = fused.int8_gemv(x, q, scale).float()
    assert (out - ref).norm() / ref.norm() < 5e-3  # bf16 output rounding
    with pytest.raises(RuntimeError, match="groups of a multiple of 16"):
        fused.int8_gemv(x, q, torch.rand(200, 192 // 8))


@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("native", [False, True])
def test_only_small_bf16_batches_take_the_low_bit_path(native_kernels, native, amx, monkeypatch):
    """Up to max_rows rows: for octavo's int4 kernel INT4_ROWS, or INT4_ROWS_AMX where the bf16
    GEMM runs on AMX tiles; MAX_ROWS for torch's."""
    from octavo.kernels import fused
    from octavo.model.quant import packed
    from octavo.platform import CpuPlatform

    flags = {"amx_tile", "amx_bf16"} if amx else {"avx2", "fma"}
    monkeypatch.setattr(packed, "cpu_platform", lambda: CpuPlatform(frozenset(flags)))
    fused.enable_native(native)
    w = _q4_weight(64, 128)
    decode = make_decode_weight(w, 4)
    limit = max_rows(decode)
    int4_limit = INT4_ROWS_AMX if amx else INT4_ROWS
    assert limit == (int4_limit if native and fused.int4_gemm_ready(torch.bfloat16) else MAX_ROWS)
    small = torch.randn(limit, 128).bfloat16()
    large = torch.randn(limit + 1, 128).bfloat16()
    weights = DenseWeights(w, decode)
    assert torch.equal(weights.matmul(small), decode.matmul(small))
    assert torch.equal(weights.matmul(large),
                       torch.nn.functional.linear(large, w))
    assert make_decode_weight(w, 16) is None  # wide sources stay dense


@pytest.mark.parametrize("native", [False, True])
def test_float32_runs_take_the_low_bit_path_up_to_their_own_limits(native_kernels, native):
    """CPUs without native bf16 run in float32: a GGUF's int4 copies serve up to INT4_ROWS_F32
    rows there and the int8 ones (the LM head) up to INT8_ROWS_F32 with octavo's kernels; with
    torch's kernels MAX_ROWS."""
    from octavo.kernels import fused

    fused.enable_native(native)
    w = _q4_weight(64, 128).float()
    for bits, fast in ((4, INT4_ROWS_F32), (8, INT8_ROWS_F32)):
        decode = make_decode_weight(w, bits)
        assert decode is not None and decode.dtype == torch.float32
        on = native and (bits == 8 or fused.int4_gemm_ready(torch.float32))
        limit = max_rows(decode)
        assert limit == (fast if on else MAX_ROWS)
        small, large = torch.randn(limit, 128), torch.randn(limit + 1, 128)
        out = DenseWeights(w, decode).matmul(small)
        assert torch.equal(out, decode.matmul(small))
        ref = torch.nn.functional.linear(small, w)
        assert (out - ref).norm() / ref.norm() < 1e-2  # w re-quantized (test_quant_kernels)
        assert torch.equal(DenseWeights(w, decode).matmul(large),
                           torch.nn.functional.linear(large, w))


@pytest.fixture(scope="module")
def bf16_pair(smollm_gguf):
    kw = dict(dtype="bfloat16", max_model_len=1024, kv_cache_memory=64 << 20)
    return LLM(str(smollm_gguf), **kw), LLM(str(smollm_gguf), decode_weights="none", **kw)


def test_decode_copies_exist_only_when_asked(bf16_pair):
    fast, dense = bf16_pair
    fast_model = fast.engine.client.core.executor.worker.runner.model
    dense_model = dense.engine.client.core.executor.worker.runner.model
    layer = fast_model.model.layers[0]
    # The default: the GGUF's codes alone, no dense weights beside them.
    assert isinstance(layer.mlp.gate_up_proj.weights, PackedWeights)
    assert isinstance(layer.mlp.gate_up_proj.weights.packed, Int4Packed)  # Q4_1 source
    head, embedding = fast_model.lm_head.weights, fast_model.model.embed_tokens
    # Q8_0: 8-bit codes in the int4 layout where its bf16 kernel runs, else grouped int8
    assert isinstance(head, PackedWeights)
    assert (isinstance(head.packed, Int4Packed) and head.packed.bits == 8
            or isinstance(head.packed, Int8Grouped))
    # the tied embedding looks its rows up in the same codes
    codes = [next(iter(p.tensors().values())).data_ptr()
             for p in (embedding.weights.packed, head.packed)]
    assert codes[0] == codes[1]
    assert not list(fast_model.model.embed_tokens.parameters())  # its dense table is gone
    assert dense_model.model.layers[0].mlp.gate_up_proj.weights.small_batch is None


def test_greedy_output_matches_dense_bf16(bf16_pair, smollm_llm):
    fast, dense = bf16_pair
    prompts = ["The capital of France is", "def fib(n):", "List three colors: red,",
               "Explain in a few sentences why the sky is blue.", "Once upon a time",
               "The best way to learn", "Q: What is 2+2?\nA:"]
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=5)
    a = fast.generate(prompts, params, use_tqdm=False)
    b = dense.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):  # the top-5 criterion against dense bf16
        for j, (p, q) in enumerate(zip(x.outputs[0].token_ids, y.outputs[0].token_ids)):
            if p != q:
                assert p in y.outputs[0].logprobs[j] and q in x.outputs[0].logprobs[j]
                break
    # ... and as close to float32 as dense bf16 is, measured robustly: the logprob of each next
    # token of texts fed in prompts of 24 tokens (each prompt's prefill takes the low-bit path,
    # as a decode step does; greedy runs' first divergences are too few to compare). Both errors
    # are bf16 rounding noise: over one text (128 tokens) either mean moved by 15% when the
    # attention kernel's rounding changed in the last bit; over these four (380) by 2 and 7%.
    texts = [
        "The capital of France is Paris. It is known for the Eiffel Tower, built in 1889 for "
        "the World's Fair. def fib(n):\n    if n < 2:\n        return n\n    return "
        "fib(n - 1) + fib(n - 2)\nMany tourists visit the city every year to see its museums.",
        "Photosynthesis is the process by which green plants use sunlight, water and carbon "
        "dioxide to make glucose and oxygen. It takes place mainly in the leaves, inside small "
        "structures called chloroplasts, which contain the green pigment chlorophyll.",
        "import json\n\ndef load(path):\n    with open(path) as f:\n        return json.load(f)"
        "\n\ndef save(path, data):\n    with open(path, 'w') as f:\n        json.dump(data, f, "
        "indent=2)\n",
        "Dear Sam, thank you for your letter. The weather here has been cold and rainy, but we "
        "spent the weekend at the lake anyway. The children learned to fish, and we cooked dinner "
        "over a fire. I hope to see you in the spring."]
    chunks = []
    for text in texts:
        ids = fast.tokenizer.encode(text)
        chunks += [ids[i:i + 24] for i in range(0, len(ids) - 12, 12)]
    errors = [_prompt_logprob_error(llm, smollm_llm, chunks) for llm in (fast, dense)]
    # The default computes prefill from the int4 codes too (no dense copy): on an AMD EPYC with
    # AVX2 only its mean error was 0.0483 against dense bf16's 0.0427 (the dense-prefill plan's
    # stayed within 1.1x); the bound keeps it within 1.2x.
    assert errors[0] <= 1.2 * errors[1], errors


def _prompt_logprob_error(llm, ref, chunks: list[list[int]]) -> float:
    """Mean |logprob - reference logprob| of each chunk's tokens after its first."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    total, count = 0.0, 0
    for chunk in chunks:  # one at a time: each prefill is a small batch of its own
        a, b = (x.generate([chunk], params, use_tqdm=False)[0] for x in (llm, ref))
        for pa, pb, t in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], chunk[1:]):
            total += abs(pa[t].logprob - pb[t].logprob)
            count += 1
    return total / count


def test_prepared_weights_reload_identically(smollm_gguf, tmp_path, monkeypatch):
    """The second start reads the prepared file: same parameters, same typed weights with the
    same decode copies."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from octavo.arch_config import read_arch_config
    from octavo.model.loader import load_model
    from octavo.model.loader.prepared_cache import FORMAT
    from octavo.model_source import resolve_model

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path))  # prepared weights and GGUF types
    # The probe below loads without the C++ kernels (its cache is empty), and the prepared
    # file is keyed by whether they are loaded: here too.
    monkeypatch.setattr("octavo.kernels.fused._native", None)
    source = resolve_model(str(smollm_gguf))
    cfg = read_arch_config(source)
    args = (source, cfg, torch.bfloat16, torch.device("cpu"), 256)
    fresh = load_model(*args)
    dense_prefill = load_model(*args, dense_prefill=True)  # its own entry
    assert isinstance(dense_prefill.model.layers[0].mlp.down_proj.weights, DenseWeights)
    _assert_same_weights(dense_prefill, load_model(*args, dense_prefill=True))
    (prepared, _) = sorted((tmp_path / "prepared").glob("*.safetensors"),
                           key=lambda p: "dense-prefill" in p.name)
    # A start from the prepared file needs no `gguf` import (0.14 s of a start): the core
    # process gets the config from its front end, so only load_model runs there.
    (tmp_path / "args.pkl").write_bytes(pickle.dumps((source, cfg)))
    probe = ("import pickle, sys, torch; from octavo.model.loader import load_model; "
             f"source, cfg = pickle.load(open({str(tmp_path / 'args.pkl')!r}, 'rb')); "
             "load_model(source, cfg, torch.bfloat16, torch.device('cpu'), 256); "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('gguf', 'yaml')))")
    run = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=dict(os.environ, OCTAVO_CACHE=str(tmp_path)), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
    reloaded = load_model(*args)
    _assert_same_weights(fresh, reloaded)
    plain = load_model(*args, pack_gemm=False, dense_prefill=True)  # the tied head's weight
    assert plain.lm_head.weights.weight is plain.model.embed_tokens.weight  # is its embedding's
    # A file without this code's layout (what the attribute-based code before it wrote, with no
    # metadata) is rebuilt, not misread.
    save_file(load_file(prepared), prepared)
    _assert_same_weights(fresh, load_model(*args))
    with safe_open(str(prepared), "pt") as f:
        assert f.metadata()["format"] == FORMAT  # written anew
    prepared.write_bytes(b"not a safetensors file")  # a broken entry is rebuilt, not trusted
    rebuilt = load_model(*args)
    _assert_same_weights(fresh, rebuilt)
    assert prepared.stat().st_size > 1000


def _assert_same_weights(fresh, reloaded) -> None:
    """The same parameters and the same typed weights, computing the same products."""
    from octavo.kernels import onednn

    for (name, a), (_, b) in zip(fresh.named_parameters(), reloaded.named_parameters()):
        assert torch.equal(onednn.dense(a), onednn.dense(b)), name
    others = dict(reloaded.named_modules())
    count = 0
    for name, module in fresh.named_modules():
        weights = getattr(module, "weights", None)
        if weights is None:
            continue
        other = others[name].weights
        assert type(other) is type(weights), name
        small = getattr(weights, "small_batch", None)
        assert type(getattr(other, "small_batch", None)) is type(small), name
        if type(weights) is PackedWeights:
            assert type(other.packed) is type(weights.packed), name
        ids = torch.tensor([0, 5, 77])
        if name.endswith("embed_tokens"):
            assert torch.equal(other.rows(ids), weights.rows(ids)), name
            continue
        x = torch.randn(2, weights.shape[1]).bfloat16()
        assert torch.equal(other.matmul(x), weights.matmul(x)), name
        count += small is not None or type(weights) is PackedWeights
    assert count > 0  # the GGUF's packed weights came back


def test_a_new_prepared_entry_replaces_the_stale_one(tmp_path):
    """An entry made by other model code is removed when its replacement is written; entries
    of another dtype or decode mode stay."""
    from torch import nn

    from octavo.model.loader.prepared_cache import save_prepared

    folder = tmp_path / "prepared"
    folder.mkdir()
    stale = folder / "m-bfloat16-int4-0123456789abcdef.safetensors"
    other_mode = folder / "m-float32-none-0123456789abcdef.safetensors"
    other_model = folder / "m2-bfloat16-int4-0123456789abcdef.safetensors"
    for f in (stale, other_mode, other_model):
        f.write_bytes(b"x")
    new = folder / "m-bfloat16-int4-fedcba9876543210.safetensors"
    save_prepared(nn.Linear(2, 2), new)
    assert new.is_file() and not stale.exists()
    assert other_mode.exists() and other_model.exists()
