"""octavo on an accelerator (issue 33): tokens and logprobs against transformers on the same
device, compiled layers against eager ones there, and a server there. The device is
OCTAVO_TEST_DEVICE (default cuda); without CUDA these skip, and `scripts/gpu-check` runs them
where a GPU is. OCTAVO_TEST_DEVICE=cpu runs them here, to check the checks themselves.

The models are tiny random ones built at test time; only a tokenizer folder is needed
(OCTAVO_TEST_TOKENIZER, a folder with SmolLM2's tokenizer.json and tokenizer_config.json, where
the catalog cannot be fetched, as on a machine with no network)."""
from __future__ import annotations

import os

import httpx
import pytest
import torch

from octavo import LLM, SamplingParams
from tests.e2e.conftest import start_server
from tests.parity.test_tiny_models import _build

DEVICE = os.environ.get("OCTAVO_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="needs CUDA (scripts/gpu-check runs these on a GPU)")


@pytest.fixture(scope="module")
def tokenizer_folder(request):
    from pathlib import Path

    given = os.environ.get("OCTAVO_TEST_TOKENIZER")
    return Path(given) if given else request.getfixturevalue("smollm_oracle_folder")


@pytest.fixture(autouse=True)
def exact_float32():
    if DEVICE == "cuda":  # TF32 products would be another computation than transformers'
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (90, 7)]


def _ours(folder, prompts, llm_out=None, dtype="float32", **options):
    llm = LLM(str(folder), device=DEVICE, dtype=dtype, max_model_len=256,
              kv_cache_memory=16 << 20, max_num_batched_tokens=64, **options)
    if llm_out is not None:
        llm_out.append(llm)
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids, torch.tensor([lp[t].logprob for lp, t in zip(
        o.outputs[0].logprobs, o.outputs[0].token_ids)])) for o in outs]


@pytest.mark.parametrize("name", ["llama-default", "qwen3-moe", "gemma3"])
def test_greedy_outputs_equal_transformers_on_the_device(tmp_path, tokenizer_folder, name):
    folder, ref = _build(tmp_path, tokenizer_folder, name)
    ref = ref.to(DEVICE)
    prompts = _prompts()
    for (tokens, logprobs), p in zip(_ours(folder, prompts), prompts):
        with torch.inference_mode():
            out = ref.generate(torch.tensor([p], device=DEVICE), do_sample=False,
                               max_new_tokens=6, pad_token_id=0)[0]
            lp = torch.log_softmax(ref(out[None]).logits[0, len(p) - 1:-1].float(), -1)
        expected = out[len(p):]
        assert tokens == expected.tolist()
        assert torch.allclose(logprobs, lp[torch.arange(len(expected)), expected].cpu(),
                              atol=1e-3)


@pytest.mark.parametrize("name, graphs", [("qwen3-moe", False), ("llama-default", True)])
def test_compiled_layers_equal_eager_ones_on_the_device(tmp_path, tokenizer_folder, name,
                                                        graphs):
    """The compiled layers' graphs, every step through them (`enforce_eager`), or their decode
    steps inside CUDA graphs (the CPU: the decode stack's)."""
    folder, _ = _build(tmp_path, tokenizer_folder, name)
    prompts = _prompts()
    eager = _ours(folder, prompts, enforce_eager=True)
    compiled = _ours(folder, prompts, enforce_eager=not graphs, compilation_level=3)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(compiled, eager):
        assert tokens == ref_tokens
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-4)


@pytest.mark.parametrize("name, dtype", [("gemma2", "float32"), ("qwen3-moe", "bfloat16")])
def test_cuda_graphs_give_the_eager_outputs_on_the_device(tmp_path, tokenizer_folder, name,
                                                          dtype):
    """Decode steps replayed from CUDA graphs (captured before the second decode step) give the
    eager steps' tokens and logprobs; a bf16 MoE's grouped GEMMs are held in them on an
    sm90/sm100 GPU. The CPU has no graphs: tests/worker/test_decode_graphs.py checks everything
    but the capture there."""
    if DEVICE != "cuda":
        pytest.skip("CUDA graphs need CUDA")
    if name == "qwen3-moe" and torch.cuda.get_device_capability()[0] not in (9, 10):
        pytest.skip("MoE layers are held in graphs on sm90/sm100 GPUs")
    folder, _ = _build(tmp_path, tokenizer_folder, name)
    prompts = _prompts()
    eager = _ours(folder, prompts, dtype=dtype, enforce_eager=True)
    graphs = []
    got = _ours(folder, prompts, dtype=dtype, cudagraph_capture_sizes=[1, 2], llm_out=graphs)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, eager):
        assert tokens == ref_tokens
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-4 if dtype == "float32" else 2e-2)
    runner = graphs[0].engine.client.core.executor.worker.runner
    assert runner.graphs.replays > 0 and runner.graphs.failed is None


def test_a_server_on_the_device_answers(tmp_path, tokenizer_folder):
    folder, _ = _build(tmp_path, tokenizer_folder, "llama-default")
    server = start_server(folder, tmp_path, "--device", DEVICE, "--max-model-len", "256")
    try:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 8
    finally:
        assert server.stop() == 0, server.log()[-3000:]
