"""FBGEMM FP8 checkpoints (`quant_method: fbgemm_fp8`, the form of Llama 4 Maverick's FP8
release): linear layers' e4m3 `weight` with a float32 `weight_scale` per output row, Llama 4's
stacked experts as e4m3 `gate_up_proj` [E, hidden, 2I] with `gate_up_proj_scale` [E, 1, 2I]
and `down_proj` [E, I, hidden] with `down_proj_scale` [E, hidden, 1]; modules named in
`modules_to_not_convert` stay dense. Written at test time from a tiny random Llama 4 and
compared with transformers on the weights they decode to."""
from __future__ import annotations

import json
import shutil

import torch
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.model.quant.microscaled import MicroscaledPacked
from tests.parity.test_tiny_models import _build

FP8_MAX = 448.0
_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 codes of w with a scale per slice along `dim` (amax / 448), the scale, and the
    weight they decode to."""
    scale = (w.abs().amax(dim, keepdim=True) / FP8_MAX).float()
    codes = (w / scale).to(torch.float8_e4m3fn)
    return codes, scale, codes.float() * scale


def test_llama4_fbgemm_fp8_checkpoint_matches_dequantized_model(tmp_path, smollm_oracle_folder):
    from transformers import AutoModelForCausalLM

    folder, _ = _build(tmp_path, smollm_oracle_folder, "llama4")
    tensors = load_file(folder / "model.safetensors")
    checkpoint, dequantized = {}, {}
    for name, w in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in _LINEARS:
            codes, scale, deq = _quantized(w, 1)  # a scale per output row, [out, 1]
            checkpoint |= {name: codes, f"{module}.weight_scale": scale}
        elif leaf == "gate_up_proj":  # [E, hidden, 2I]: a scale per output column
            codes, scale, deq = _quantized(w, 1)
            checkpoint |= {name: codes, f"{name}_scale": scale}
        elif leaf == "down_proj":  # [E, I, hidden]: its scales stored [E, hidden, 1]
            codes, scale, deq = _quantized(w, 1)
            checkpoint |= {name: codes, f"{name}_scale": scale.transpose(1, 2).contiguous()}
        else:  # the router, norms, embeddings, LM head
            checkpoint[name], deq = w, w
        dequantized[name] = deq.contiguous()
    dense = tmp_path / "dense"
    shutil.copytree(folder, dense)
    save_file(dequantized, str(dense / "model.safetensors"))
    save_file(checkpoint, str(folder / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
        "modules_to_not_convert": ["model.layers.0.feed_forward.router",
                                   "model.layers.1.feed_forward.router", "lm_head"]}
    (folder / "config.json").write_text(json.dumps(config))
    ref = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()

    prompt = torch.randint(100, 49000, (60,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
        ref_tokens = ref.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=8,
                                  pad_token_id=0)[0, len(prompt):].tolist()
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)
    try:
        model = llm.engine.client.core.executor.worker.runner.model
        experts = next(m for m in model.modules() if hasattr(m, "expert_linears"))
        packed = experts.expert_linears[0][0].weights.packed
        assert isinstance(packed, MicroscaledPacked) and packed.codes.dtype == torch.uint8
        out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                                    prompt_logprobs=0), use_tqdm=False)[0]
    finally:
        llm.engine.shutdown()
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    want = ref_lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, want, atol=1e-4), (ours - want).abs().max()
    assert out.outputs[0].token_ids == ref_tokens
