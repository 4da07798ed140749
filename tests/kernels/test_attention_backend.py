"""--attention-backend (vLLM's names): CPU_ATTN (octavo's C++ kernel) and TORCH_SDPA (torch ops
over gathered keys) give the same tokens and logprobs; TORCH_SDPA never calls the kernel; names
octavo has not built, unknown ones and CPU_ATTN off the CPU are refused by name."""
from __future__ import annotations

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.config import EngineConfig
from octavo.kernels import fused
from tests.parity.test_tiny_models import _build


def test_backend_names():
    assert EngineConfig.from_kwargs(attention_backend="torch_sdpa").device.attention_backend \
        == "TORCH_SDPA"
    assert EngineConfig.from_kwargs().device.attention_backend == "AUTO"
    for name in ("FLASH_ATTN", "flashinfer"):
        with pytest.raises(NotImplementedError, match=f"attention_backend {name}: octavo has "
                                                      "no such backend yet"):
            EngineConfig.from_kwargs(attention_backend=name)
    with pytest.raises(ValueError, match="attention_backend must be auto or one of CPU_ATTN, "
                                         "TORCH_SDPA, got 'xformers'"):
        EngineConfig.from_kwargs(attention_backend="xformers")
    with pytest.raises(ValueError, match="CPU_ATTN runs on the CPU, not on cuda"):
        EngineConfig.from_kwargs(attention_backend="CPU_ATTN", device="cuda")


def _run(folder, **options):
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=64, **options)
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(100, 49000, (n,), generator=gen).tolist() for n in (120, 9, 33)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                logprobs=1), use_tqdm=False)
    return llm, [(o.outputs[0].token_ids, torch.tensor([lp[t].logprob for lp, t in zip(
        o.outputs[0].logprobs, o.outputs[0].token_ids)])) for o in outs]


def test_torch_sdpa_gives_the_kernel_s_outputs_without_it(tmp_path, smollm_oracle_folder,
                                                          monkeypatch):
    folder, _ = _build(tmp_path, smollm_oracle_folder, "gemma2")  # windows and softcaps
    _, kernel = _run(folder)
    assert fused.native_ready()  # the first engine loaded them: CPU_ATTN took its queries
    monkeypatch.setattr(fused, "decode_attention",
                        lambda *a, **k: pytest.fail("TORCH_SDPA called the C++ kernel"))
    llm, torch_sdpa = _run(folder, attention_backend="TORCH_SDPA")
    assert llm.engine.client.core.executor.worker.runner.attention_backend.name == "TORCH_SDPA"
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(torch_sdpa, kernel):
        assert tokens == ref_tokens
        assert torch.allclose(logprobs, ref_logprobs, atol=1e-4)
