"""Each C++ kernel against its PyTorch reference, in float32 and bfloat16."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from octavo.kernels import fused

DTYPES = [torch.float32, torch.bfloat16]


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    # bf16: one rounding step of the output (2^-8 relative) can differ where fp32 sums differ.
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.allclose(a.float(), b.float(), rtol=tol, atol=tol), (a - b).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 576), (7, 64), (33, 960)])
def test_rms_norm(native_kernels, dtype, rows, width):
    x = torch.randn(rows, width).to(dtype) * 3
    w = torch.randn(width).to(dtype)
    _close(fused.rms_norm(x, w, 1e-5), fused.rms_norm_reference(x, w, 1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [640, 256, 72])  # Gemma 3's hidden and head sizes; no SIMD
def test_one_plus_rms_norm_on_strided_heads(native_kernels, dtype, width):
    """Gemma's norm (1 + w in float32, one rounding) on the q heads of a qkv row: strided."""
    from octavo.model.layers.norm import GemmaRMSNorm

    norm = GemmaRMSNorm(width, 1e-6)
    norm.weight.data.copy_(torch.randn(width) * 0.5)
    qkv = torch.randn(7, 3 * 2 * width).to(dtype) * 3
    q = qkv[:, :2 * width].view(7, 2, width)
    got = norm(q)
    fused._native, saved = None, fused._native  # the Python reference
    try:
        want = norm(q)
    finally:
        fused._native = saved
    assert got.shape == q.shape and got.dtype == dtype
    _close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_qkv_views(native_kernels, dtype):
    tokens, heads, kv_heads, dim, max_pos = 5, 9, 3, 64, 100
    angles = torch.outer(torch.arange(max_pos).double(),
                         1.0 / 10000 ** (torch.arange(0, dim, 2).double() / dim))
    cos, sin = angles.cos().float(), angles.sin().float()
    positions = torch.tensor([0, 3, 99, 42, 7])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)  # strided, not contiguous
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    want_q, want_k = fused.rotate_reference(q, c, s), fused.rotate_reference(k, c, s)
    got_q, got_k = fused.rotary(positions, q, k, cos, sin, (c, s))
    _close(got_q, want_q, dtype)
    _close(got_k, want_k, dtype)
    assert got_q.data_ptr() == q.data_ptr()  # rotated in place, no copy


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(6, 1536), (1, 1536), (3, 37)])  # 37: the scalar tail
def test_silu_and_mul(native_kernels, dtype, rows, width):
    x = torch.randn(rows, 2 * width).to(dtype) * 4
    gate, up = x.chunk(2, -1)
    _close(fused.silu_and_mul(x), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_at_extreme_gates(native_kernels, dtype):
    """Gates far below zero (e^-g beyond float's range) give silu's tiny values, not NaN."""
    gate = torch.tensor([-300., -120., -90., -80., -20., -1e-3, 0., 1e-3, 20., 90., 300., 1e30,
                         -3e38, 5., -5., 1.]).to(dtype)
    x = torch.cat([gate, torch.full_like(gate, 1.5)]).view(1, -1)
    out = fused.silu_and_mul(x)
    assert torch.isfinite(out).all()
    _close(out, F.silu(gate.view(1, -1)) * 1.5, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_rows(native_kernels, dtype):
    cache = torch.zeros(2, 8, 4, 3, 16, dtype=dtype)
    want = cache.clone()
    k, v = torch.randn(5, 3, 16), torch.randn(5, 3, 16)  # fp32 in, cast to the cache dtype
    slots = torch.tensor([31, 0, 5, 17, 4])
    fused.write_kv(cache, k, v, slots)
    want[0].view(-1, 3, 16)[slots] = k.to(dtype)
    want[1].view(-1, 3, 16)[slots] = v.to(dtype)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("heads, dk, dv", [(4, 16, 16), (3, 32, 24), (16, 128, 128)])
def test_delta_rule_step_moves_the_rows_states_in_place(native_kernels, heads, dk, dv):
    """The linear attention's recurrent step, three requests at rows 5, 0 and 2 of 6: their
    states and outputs as the PyTorch form's, the other rows untouched."""
    torch.manual_seed(0)
    state = torch.randn(6, heads, dk, dv) * 0.3
    rows = torch.tensor([5, 0, 2])
    q, k = (F.normalize(torch.randn(3, heads, dk), dim=-1) for _ in range(2))
    v, beta, g = torch.randn(3, heads, dv), torch.rand(3, heads), -torch.rand(3, heads)
    want_state = state.clone()
    want = fused.delta_rule_step_reference(want_state, rows, q, k, v, beta, g)
    out = fused.delta_rule_step(state, rows, q, k, v, beta, g)
    _close(out, want, torch.float32)
    _close(state, want_state, torch.float32)
    assert torch.equal(state[[1, 3, 4]], want_state[[1, 3, 4]])
    with pytest.raises(RuntimeError, match="row out of range"):
        fused.delta_rule_step(state, torch.tensor([0, 1, 6]), q, k, v, beta, g)


def test_kernels_can_be_switched_off(native_kernels):
    assert fused.enable_native(False) is False
    assert not fused.native_active(torch.zeros(1))
    assert fused.enable_native(True) is True


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (20, None), (None, 50.0)])
@pytest.mark.parametrize("seq_lens", [[1, 17, 130, 64], [130], [1], [40, 3, 129]],
                         ids=["4 requests", "1 long", "1 token", "3 requests"])
def test_decode_attention_matches_padded_path(native_kernels, dtype, window, softcap, seq_lens):
    """With fewer requests than threads each context is split into key ranges that are
    merged afterwards; with more, each request is one work item."""
    _check_decode_attention(dtype, window, softcap, seq_lens, heads=9, kv_heads=3, dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads, kv_heads, dim", [(14, 2, 64), (4, 1, 256), (20, 1, 128),
                                                  (2, 2, 128), (16, 2, 64)])
def test_decode_attention_groups_of_query_heads(native_kernels, dtype, heads, kv_heads, dim):
    """The query heads of a KV head are computed together (AVX2, float32 queries over a cache of
    any dtype: 8 at a time, so 20 heads take passes of 8, 8 and 4); every group size and head
    size gives the padded path's result."""
    _check_decode_attention(dtype, None, 30.0, [1, 40, 131, 9, 77], heads, kv_heads, dim,
                            q_dtype=torch.float32)


def _check_decode_attention(dtype, window, softcap, seq_lens, heads, kv_heads, dim,
                            q_dtype=None):
    import numpy as np

    from octavo.kernels.paged_attention import build_plan, paged_attention, step_layout

    block_size, num_blocks = 16, 50
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).to(dtype)
    seq_lens = np.array(seq_lens)
    n = len(seq_lens)
    table = np.random.default_rng(0).permutation(num_blocks)[:n * 9].reshape(n, 9)
    q = torch.randn(n, heads, dim).to(q_dtype or dtype)
    query_lens = np.ones(n, np.int64)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = []
        for native in (False, True):
            plan = build_plan(step_layout(query_lens, seq_lens), table, block_size, window,
                              native_decode=native)
            outs.append(paged_attention(q, cache, plan, dim ** -0.5, softcap))
    finally:
        torch.set_num_threads(threads)
    _close(outs[1], outs[0], dtype)


def test_background_build_switches_over_when_ready(native_kernels, monkeypatch):
    """A server starts at once: the kernels come from a build beside it and take over when
    ready (the build itself: tests/kernels/test_kernel_build.py)."""
    import threading

    from octavo.kernels import build, native

    module = fused._native
    release = threading.Event()
    built = []

    def slow_build():
        release.wait(10)
        built.append(True)
        return 0

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "_is_cached", lambda: bool(built))
    monkeypatch.setattr(native, "last_failure", lambda: None)
    monkeypatch.setattr(build, "run_beside_engine", slow_build)
    monkeypatch.setattr(native, "_load_built", lambda key, library: module)
    assert fused.enable_native("background") is False  # PyTorch ops serve meanwhile
    assert not fused.native_active(torch.zeros(1))
    release.set()
    native._state["thread"].join(10)
    assert fused.native_ready() and fused._native is module
    assert fused.enable_native("off") is False


@pytest.mark.parametrize("option, value", [("native_kernels", "fast"), ("device", "tpu"),
                                           ("num_threads", 0)])
def test_bad_device_options_name_the_field(option, value):
    from octavo.config import EngineConfig

    with pytest.raises(ValueError, match=option):
        EngineConfig.from_kwargs(**{option: value})


def test_build_clears_a_lock_left_by_a_killed_build(tmp_path, monkeypatch):
    """A server stopped while its kernels built leaves cpp_extension's lock file behind; the next
    build must not wait on it forever (it did: every later start served with PyTorch ops)."""
    from torch.utils import cpp_extension

    from octavo.kernels import native

    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "_build_key", lambda: "k")
    monkeypatch.setattr(native, "_opened", {})  # no library opened in this process yet
    build_dir = tmp_path / "kernels" / "k"
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    built = object()

    def fake_load(name, sources, build_directory, **kwargs):
        assert not (Path(build_directory) / "lock").exists()  # cpp_extension would wait on it

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(native, "_open_library", lambda key, library: built)
    assert native.build() is built
    assert (build_dir / "ready").is_file()


def test_the_kernels_trace_under_torch_compile(native_kernels):
    """Each op has its output shape registered (register_fake): FakeTensor tracing and
    torch.compile (fullgraph) take graphs that call them, with the eager results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    def step(x, w, h, q, scale):
        return (fused.rms_norm(x, w, 1e-6).sum() + fused.silu_and_mul(h).sum()
                + fused.int8_gemv(x, q, scale).sum())

    x, w, h = torch.randn(3, 64), torch.randn(64), torch.randn(3, 128)
    q, scale = torch.randint(-127, 128, (32, 64), dtype=torch.int8), torch.rand(32)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    assert torch.allclose(compiled(x, w, h, q, scale), step(x, w, h, q, scale))
    module = fused.native_module()
    with FakeTensorMode():
        fx = torch.empty(5, 64)
        assert module.rms_norm(fx, torch.empty(64), 1e-6).shape == (5, 64)
        assert module.silu_and_mul(torch.empty(5, 128)).shape == (5, 64)
        assert module.int8_gemv(fx, torch.empty(32, 64, dtype=torch.int8),
                                torch.empty(32)).shape == (5, 32)
        codes = torch.empty(2, 16, 32, dtype=torch.uint8)  # 32 rows, K = 64
        assert module.int4_dequantize(codes, torch.empty(2, 2, 2, 16), None, 0, 2, True).shape \
            == (32, 64)
