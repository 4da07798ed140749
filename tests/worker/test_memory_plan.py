"""The memory plan on a GPU (worker/memory.py): its arithmetic, the core taking all it leaves,
and the profiled steps themselves, run here on the CPU (the GPU's allocator statistics are
CUDA's; the steps are the device-independent part)."""
from __future__ import annotations

import logging

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import EngineConfig
from octavo.worker import memory
from octavo.worker.memory import GpuPlan
from tests.core.test_kv_budget import _core
from tests.parity.test_tiny_models import _build

GiB = 1 << 30


def test_the_kv_cache_takes_what_the_share_leaves():
    plan = GpuPlan(total=80 * GiB, fraction=0.9, held=10 * GiB, activations=2 * GiB,
                   graphs=GiB, free=69 * GiB)
    assert plan.kv_cache == 59 * GiB  # 72 GiB for the engine, less what it holds and needs
    text = plan.describe(torch.device("cuda", 0), 2048)
    assert "72.00 GiB for this engine" in text and "KV cache up to 59.00 GiB" in text
    assert "a 2048-token step" in text and "7.00 GiB of the GPU left free" in text
    # another process holds much of the GPU: never more than is free
    assert GpuPlan(80 * GiB, 0.9, 10 * GiB, 2 * GiB, GiB, free=30 * GiB).kv_cache == 27 * GiB
    assert GpuPlan(80 * GiB, 0.1, 10 * GiB, 2 * GiB, GiB, free=69 * GiB).kv_cache == 0


def test_on_a_gpu_the_core_takes_all_the_plan_leaves(caplog):
    assert EngineConfig.from_kwargs(device="cuda").kv_memory_fraction == 0.9
    assert EngineConfig.from_kwargs().kv_memory_fraction == 0.5
    assert EngineConfig.from_kwargs(kv_cache_memory_fraction=0.3).kv_memory_fraction == 0.3
    with caplog.at_level(logging.INFO):
        core, ex = _core(2048, 16 * 1024, available=20 * GiB, device="cuda")
    assert ex.init_calls[0][0] == 20 * GiB  # not one request's worth, as on the CPU
    assert "the GPU's plan leaves it (automatic: all of it)" in caplog.text
    with caplog.at_level(logging.WARNING):
        core, _ = _core(32768, 16 << 20, available=4 * GiB, device="cuda")
    assert core.max_model_len == 4096
    assert "the 4.00 GiB the GPU's memory plan leaves for the KV cache" in caplog.text
    with pytest.raises(ValueError, match="cannot hold even one KV block"):
        _core(32768, 16 << 20, available=1 << 20, device="cuda")


def _generate(llm):
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (70, 5)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(
        o.outputs[0].logprobs, o.outputs[0].token_ids)]) for o in outs]


@pytest.mark.parametrize("name", ["llama-default", "qwen3-moe", "qwen3-next"])
def test_the_profiled_steps_run_on_every_kind_of_model(tmp_path, smollm_oracle_folder,
                                                       monkeypatch, rerun_capture, name):
    """The plan's two steps (the largest prompt into a temporary cache; the largest decode
    graph's padding rows, where the model has graphs) run on dense, MoE and linear-attention
    models, and leave the engine's own cache and outputs as they were."""
    folder, _ = _build(tmp_path, smollm_oracle_folder, name)
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=128, native_kernels="off", enable_prefix_caching=False)
    before = _generate(llm)
    worker = llm.engine.client.core.executor.worker
    ran = []
    monkeypatch.setattr(memory, "peak_of", lambda device, step: ran.append(step()) or 1)
    monkeypatch.setattr(memory, "plan", lambda device, fraction, free_at_start, activations,
                        graphs: GpuPlan(GiB, fraction, 0, activations, graphs, GiB))
    plan = worker._plan_gpu_memory()
    graphs = worker.runner.graphs
    assert len(ran) == (1 if graphs is None else 2) and plan.activations == 1
    assert (graphs is None) == (name != "llama-default")  # MoE, linear attention: no graphs
    if graphs is not None:
        assert ran[1].shape == (graphs.sizes[-1], 64)  # the largest bucket's hidden states
        assert graphs.kv_caches is worker.runner.kv_caches  # bound again to the real cache
    after = _generate(llm)  # (now through the graphs the first run had asked for)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(after, before):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 1e-5
