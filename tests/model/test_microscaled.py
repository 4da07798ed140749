"""Microscaled weights kept packed (quant/microscaled.py, csrc/microscaled.h): the GEMV and the
dequantized tiles against dequantize-then-matmul on random codes of every table (MXFP4's e2m1
with e8m0 scales per 32, MXFP8's e4m3 codes, NVFP4-like e4m3 scales per 16, FP8 with float32
scales per block or per row) and every batch class; the OCP quantizer; and a gpt-oss checkpoint
whose experts are MXFP4, packed at test time, against transformers on the dequantized weights."""
from __future__ import annotations

import json

import pytest
import torch

from octavo.model.quant.microscaled import (FP4_VALUES, MicroscaledPacked, e4m3_table,
                                            e8m0_table, quantize_mxfp4)

pytestmark = pytest.mark.usefixtures("native_kernels")


def _random_weight(n: int, k: int, bits: int, block: int, scale_lut: torch.Tensor,
                   gen: torch.Generator) -> MicroscaledPacked:
    codes = torch.randint(0, 256, (n, k * bits // 8), generator=gen, dtype=torch.uint8)
    if bits == 8:  # e4m3's NaN bytes (0x7f, 0xff) are not weights
        codes[(codes & 0x7F) == 0x7F] = 0
    table = torch.tensor(FP4_VALUES) if bits == 4 else e4m3_table()
    if scale_lut.numel() == 0:  # FP8 checkpoints' float32 scales
        scales = torch.rand(n, k // block, generator=gen) * 0.01 + 1e-4
    elif scale_lut[127] == 1.0:  # e8m0
        scales = torch.randint(120, 131, (n, k // block), generator=gen, dtype=torch.uint8)
    else:
        scales = torch.randint(40, 60, (n, k // block), generator=gen, dtype=torch.uint8)
    return MicroscaledPacked(codes, scales, table, scale_lut, block, torch.float32)


FORMATS = {"mxfp4": (4, 32, e8m0_table()), "mxfp8": (8, 32, e8m0_table()),
           "nvfp4": (4, 16, e4m3_table() * 0.5), "fp8-blocks": (8, 32, torch.empty(0)),
           "fp8-rows": (8, 0, torch.empty(0))}


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_equal_the_dequantized_matmul(fmt, rows, dtype):
    bits, block, scale_lut = FORMATS[fmt]
    gen = torch.Generator().manual_seed(rows)
    for n, k in ((8, 64), (37, 96), (130, 256)):
        w = _random_weight(n, k, bits, block or k, scale_lut, gen)  # 0: a scale per row
        x = torch.randn(rows, k, generator=gen).to(dtype)
        dense = w.reference()
        want = x.float() @ dense.t()
        got = w.matmul(x)
        assert got.dtype == dtype and got.shape == (rows, n)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert torch.allclose(got.float(), want, rtol=tol, atol=tol * want.abs().max()), \
            (fmt, rows, n, k, (got.float() - want).abs().max())
        assert torch.equal(w.dequantize(3, n, torch.float32), dense[3:])


def test_the_ocp_quantizer_rounds_each_block_to_its_grid():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(6, 64, generator=gen) * 3
    codes, scales = quantize_mxfp4(w)
    packed = MicroscaledPacked(codes, scales, torch.tensor(FP4_VALUES), e8m0_table(), 32,
                               torch.float32)
    back = packed.reference()
    # every block's largest value fits e2m1's 6 after its power-of-two scale, and each value is
    # the grid point nearest to it
    step = back.view(6, 2, 32).abs().amax(-1) / w.view(6, 2, 32).abs().amax(-1)
    assert (step > 0.6).all() and (step < 1.4).all()
    again = MicroscaledPacked(*quantize_mxfp4(back), torch.tensor(FP4_VALUES), e8m0_table(), 32,
                              torch.float32).reference()
    assert torch.equal(again, back)  # grid values are fixed points


def mxfp4_gpt_oss(tmp_path, smollm_oracle_folder):
    """A tiny gpt-oss whose experts are an MXFP4 checkpoint's blocks and scales, and
    transformers' model holding the weights they decode to."""
    import safetensors.torch

    from tests.parity.test_tiny_models import _build

    folder, ref = _build(tmp_path, smollm_oracle_folder, "gpt-oss")
    path = folder / "model.safetensors"
    tensors = safetensors.torch.load_file(path)
    with torch.no_grad():
        for name in list(tensors):
            if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                continue
            stacked = tensors.pop(name)  # [E, in, out]
            blocks, scales, decoded = [], [], []
            for w in stacked.transpose(1, 2):  # [out, in]
                codes, s = quantize_mxfp4(w)
                blocks.append(codes.view(w.shape[0], -1, 16))
                scales.append(s)
                decoded.append(MicroscaledPacked(codes, s, torch.tensor(FP4_VALUES),
                                                 e8m0_table(), 32, torch.float32).reference())
            tensors[name + "_blocks"], tensors[name + "_scales"] = (torch.stack(blocks),
                                                                    torch.stack(scales))
            ref.get_parameter(name).copy_(torch.stack(decoded).transpose(1, 2))
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
        "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    return folder, ref


def test_gpt_oss_with_mxfp4_experts_matches_transformers_on_the_dequantized_weights(
        tmp_path, smollm_oracle_folder):
    """The experts' blocks and scales stay packed (4.25 bits a weight) and the model equals
    transformers given the weights they decode to: prompt logprobs within 1e-4, greedy tokens."""
    from octavo import LLM, SamplingParams

    folder, ref = mxfp4_gpt_oss(tmp_path, smollm_oracle_folder)
    prompt = torch.randint(100, 49000, (90,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
        ref_tokens = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              max_num_batched_tokens=32)  # prefill chunks past the GEMV's 16 rows: the tiles
    model = llm.engine.client.core.executor.worker.runner.model
    experts = model.model.layers[0].mlp.experts
    packed = experts.expert_linears[0][0].weights.packed
    assert isinstance(packed, MicroscaledPacked) and packed.codes.dtype == torch.uint8
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                prompt_logprobs=0), use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    want = ref_lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    assert out.outputs[0].token_ids == ref_tokens
