"""Perplexity on a fixed English text shipped with the tests, computed by octavo; each mode stays
within a stated bound of float32.

- SmolLM2 (its float32 weights, dequantized from the catalog GGUF, as a safetensors folder) in
  float32, bfloat16, and --quantization int8 / int4 (quantized at load) in the dtype `auto` means
  on this CPU (bf16 where it is native, float32 on AVX2: the plan users get).
- Qwen2.5-0.5B (the catalog's Q4_K_M GGUF, run from the GGUF itself) in float32 (the GGUF
  dequantized), bf16, and --quantization int8 / int4 in the auto dtype: the GGUF's own codes
  kept packed (quant/gguf.py). The Q4_K tensors become int4 exactly; the Q5_0/Q6_K/Q8_0 ones
  (most of the file) are re-quantized, to int8 per channel or to int4 min/max per 32."""
from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.model.quant.weights import PackedWeights

TEXT = Path(__file__).parent.parent / "data" / "perplexity_text.txt"
WINDOW = 1100  # tokens scored: the text's first 1100 (of about 2200), in one request
# mode -> (dtype, quantization, most perplexity may rise over float32, relative). Measured on
# 2 windows of 1100 tokens: float32 20.61; bf16 +0.13%, int8 +0.34%, int4 +0.1% (the weights came
# from a Q4_1 GGUF: 4-bit min/max per 32 inputs, which int4 reproduces); in float32 (AMD EPYC,
# AVX2 only) int8 +0.17%, int4 +0.00%; not run here: fp8 weights +1.7%, an fp8 KV cache
# (kv_cache_dtype="fp8_e4m3", bf16) +0.56%. The test scores the first window only (half the
# time): on the AMD EPYC AVX2 machine float32 19.46, bf16 -0.14%, int8 +0.05%, int4 +0.09%.
MODES = {"bf16": ("bfloat16", None, 0.01), "int8": ("auto", "int8", 0.015),
         "int4": ("auto", "int4", 0.03)}


def perplexity(folder: Path, dtype: str, quantization: str | None,
               kv_cache_dtype: str = "auto") -> float:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(TEXT.read_text()).ids
    windows = [ids[:WINDOW]]
    llm = LLM(str(folder), dtype=dtype, quantization=quantization, max_model_len=WINDOW + 8,
              kv_cache_memory=64 << 20, max_num_batched_tokens=WINDOW,
              kv_cache_dtype=kv_cache_dtype)
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-o.prompt_logprobs[p][w[p]].logprob for o, w in zip(outs, windows)
           for p in range(1, len(w))]
    del llm
    gc.collect()
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def fp32_perplexity(smollm_oracle_folder):
    return perplexity(smollm_oracle_folder, "float32", None)


def test_fp32_perplexity_is_that_of_a_working_model(fp32_perplexity):
    assert 3 < fp32_perplexity < 40, fp32_perplexity


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN bf16 GEMM")
@pytest.mark.parametrize("mode", list(MODES))
def test_quantized_perplexity_close_to_fp32(smollm_oracle_folder, fp32_perplexity, mode):
    dtype, quantization, bound = MODES[mode]
    ppl = perplexity(smollm_oracle_folder, dtype, quantization)
    assert ppl <= fp32_perplexity * (1 + bound), (mode, ppl, fp32_perplexity)


# Qwen2.5-0.5B: the first QWEN_TOKENS tokens of the text in one request, to keep the four loads and
# prefills of a 0.5B model near a minute on 2 cores (once the prepared weights are cached). Measured
# on those 256 tokens: float32 36.74; bf16 +0.06%, int8 +0.89% (per-channel re-quantizing adds
# 1.1-1.8% relative weight error to the Q5_0/Q6_K/Q8_0 tensors; the untied LM head is int8 too),
# int4 +7.9% (the 5- to 8-bit tensors lose 8-11% to 4-bit min/max per 32: int4 is the smallest
# form, not a faithful one, for a Q4_K_M file whose tensors are mostly Q5_0); in float32 (AVX2)
# int8 +0.05%, int4 +7.7%. The bounds leave room for other CPUs' rounding.
# "packed" is the default: the GGUF's own codes alone, prefill with int8-quantized activations
# where the CPU has AVX-512 VNNI (and bf16 tiles elsewhere): +0.08% on 1024 tokens (AMD EPYC
# AVX-512), where bf16 with dense weights gave +0.15%.
QWEN_TOKENS = 256
# (bf16 with the dense weights is SmolLM2's case above: its bound is checked there once.)
QWEN_MODES = {"int8": ("auto", "int8", 0.02), "int4": ("auto", "int4", 0.12),
              "packed": ("auto", None, 0.01)}


def gguf_perplexity(path: Path, dtype: str, quantization: str | None,
                    packed: bool = False) -> float:
    llm = LLM(str(path), dtype=dtype, quantization=quantization,
              decode_weights="auto" if packed else "none",
              max_model_len=QWEN_TOKENS + 8, kv_cache_memory=64 << 20,
              max_num_batched_tokens=QWEN_TOKENS)
    head = llm.engine.client.core.executor.worker.runner.model.lm_head
    packed_head = isinstance(head.weights, PackedWeights)
    assert packed_head == (packed or quantization is not None)  # untied: the packed head alone
    ids = llm.tokenizer.encode(TEXT.read_text())[:QWEN_TOKENS]
    out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    nll = [-out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]
    del llm
    gc.collect()
    return math.exp(sum(nll) / len(nll))


@pytest.fixture(scope="module")
def qwen_gguf():
    from octavo.model_source import pull

    return pull("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="module")
def qwen_fp32_perplexity(qwen_gguf):
    return gguf_perplexity(qwen_gguf, "float32", None)


def test_qwen_fp32_perplexity_is_that_of_a_working_model(qwen_fp32_perplexity):
    assert 5 < qwen_fp32_perplexity < 80, qwen_fp32_perplexity


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="needs oneDNN bf16 GEMM")
@pytest.mark.parametrize("mode", list(QWEN_MODES))
def test_qwen_gguf_perplexity_close_to_fp32(qwen_gguf, qwen_fp32_perplexity, mode):
    dtype, quantization, bound = QWEN_MODES[mode]
    ppl = gguf_perplexity(qwen_gguf, dtype, quantization, packed=mode == "packed")
    assert ppl <= qwen_fp32_perplexity * (1 + bound), (mode, ppl, qwen_fp32_perplexity)
