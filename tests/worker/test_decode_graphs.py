"""CUDA graphs of decode steps (worker/decode_graphs.py), checked on the CPU.

The CPU has no graphs, so `capturer` is replaced by a stand-in for torch.cuda.CUDAGraph
(conftest.py's `rerun_capture`): it runs the step's function once when "capturing" and again at
each replay, over the same static buffers, each time under a guard that fails on what a CUDA
graph cannot hold: reading the device's data on the host (.item(), .tolist(), .numpy(),
nonzero, a boolean index, bincount).
Everything else is the engine's own path: buckets, padding rows, the scratch block, the masks
computed in the graph, capture in the idle work. The real capture runs in tests/gpu.
"""
from __future__ import annotations

import logging

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model.layers import moe
from octavo.worker import decode_graphs
from octavo.worker.decode_graphs import DecodeGraphs, default_capture_sizes, usable_sizes
from tests.parity.test_tiny_models import _build


def _run(folder, **options):
    llm = LLM(str(folder), dtype="float32", max_model_len=256, block_size=8,
              kv_cache_memory=16 << 20, max_num_batched_tokens=64, native_kernels="off",
              **options)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (150, 7, 30, 50)]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=2)
              for n in (16, 6, 10, 12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, torch.tensor([lp[t].logprob for lp, t in zip(
        o.outputs[0].logprobs, o.outputs[0].token_ids)])) for o in outs]


def _graphs(llm) -> DecodeGraphs | None:
    return llm.engine.client.core.executor.worker.runner.graphs


@pytest.mark.parametrize("name", ["llama-default", "gemma2"])
def test_decode_graphs_give_the_eager_outputs(tmp_path, smollm_oracle_folder, rerun_capture,
                                              name):
    """Four requests of different lengths and output counts, buckets of 1 and 3 requests:
    steps of 4 run eagerly, steps of 3 and 2 through the 3-request graph (2 with a padding
    row), the last through the 1-request one, over 32-block contexts (the 150-token prompt;
    Gemma 2: 32-token windows and softcaps)."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    _, eager = _run(folder, enforce_eager=True)
    llm, got = _run(folder, cudagraph_capture_sizes=[3, 1])
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, eager):
        assert tokens == ref_tokens
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-5)
    graphs = _graphs(llm)
    assert sorted(graphs.graphs) == [(1, 32), (3, 32)]
    assert graphs.replays >= 5 and len(rerun_capture) == graphs.replays + len(graphs.graphs)
    assert graphs.scratch_block == llm.engine.client.core.num_blocks


@pytest.mark.parametrize("name", ["qwen3-moe", "gpt-oss"])
def test_moe_decode_graphs_hold_grouped_gemms(tmp_path, smollm_oracle_folder, rerun_capture,
                                              monkeypatch, name):
    """Where MoE layers run their experts as grouped GEMMs counted on the device (bf16 on an
    sm90/sm100 GPU; here the CPU is made one), their decode steps are graphs too: the guard
    finds no host read, and the outputs are the loop's over the experts (gpt-oss: biases,
    sinks, windows)."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    _, loop = _run(folder, enforce_eager=True)
    monkeypatch.setattr(moe, "GROUPED_DEVICES", ("cpu",))
    monkeypatch.setattr(moe, "grouped_gemm_on_device", lambda device, dtype: True)
    llm, got = _run(folder, cudagraph_capture_sizes=[3, 1])
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, loop):
        assert tokens == ref_tokens
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-4)
    assert sorted(_graphs(llm).graphs) == [(1, 32), (3, 32)]


def test_models_whose_step_reads_the_device_on_the_host_run_eagerly(
        tmp_path, smollm_oracle_folder, rerun_capture, caplog):
    """A mixture of experts looping over its experts counts their rows on the host (the CPU's
    way; a GPU's without grouped GEMMs): no graphs, and the start says why. Forced through the
    graph's function anyway, the guard stops it: what the guard checks is real."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    with caplog.at_level(logging.INFO, logger="octavo.worker.worker"):
        llm, _ = _run(folder)
    assert _graphs(llm) is None
    assert "without CUDA graphs: its mixture-of-experts layers read their experts' row counts" \
        in caplog.text
    runner = llm.engine.client.core.executor.worker.runner
    forced = DecodeGraphs(runner.model, torch.device("cpu"), decode_graphs.capturer(None),
                          (2,), 8, 32, None)
    forced.bind(runner.kv_caches, scratch_block=0)
    forced.ready((2, 16))
    forced.capture_wanted()
    assert "AssertionError: a captured step read" in forced.failed and not forced.graphs


def test_buckets():
    graphs = DecodeGraphs(None, torch.device("cpu"), None, (1, 2, 4, 8), 16, 100, None)
    assert graphs.bucket(3, 10) == (4, 16)
    assert graphs.bucket(8, 257) == (8, 32)
    assert graphs.bucket(1, 1600) == (1, 100)  # at most a full-length request's blocks
    assert graphs.bucket(9, 10) is None  # past the largest: eager
    assert DecodeGraphs(None, torch.device("cpu"), None, (1,), 16, 1000, None).bucket(
        1, 8193) is None  # past MAX_CAPTURED_CONTEXT: eager
    assert default_capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_capture_sizes(3) == (1, 2, 3)
    assert default_capture_sizes(1000)[-3:] == (496, 504, 512)
    assert usable_sizes((1, 2, 4, 8, 16), 6) == (1, 2, 4, 8)  # 16 rows: never a step
    assert usable_sizes((1, 2), 6) == (1, 2)


def test_a_capture_that_fails_turns_the_graphs_off(tmp_path, smollm_oracle_folder, monkeypatch,
                                                   caplog):
    """A step the refusals missed fails its capture: a warning, and the engine goes on with
    the eager steps' outputs."""
    def failing(forward):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(decode_graphs, "capturer", lambda device: failing)
    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama-default")
    _, eager = _run(folder, enforce_eager=True)
    with caplog.at_level(logging.WARNING, logger="octavo.worker.decode_graphs"):
        llm, got = _run(folder, cudagraph_capture_sizes=[3, 1])
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in eager]
    graphs = _graphs(llm)
    assert not graphs.graphs and graphs.replays == 0 and "stream is capturing" in graphs.failed
    assert "CUDA graphs turned off: capturing the decode step of 3 requests failed" in caplog.text

