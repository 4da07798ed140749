"""Tiny GPTQ, AWQ and FP8 checkpoints packed here from the formats' descriptions, loaded by
octavo and compared with transformers running the same weights dequantized in float32; and
--quantization on an unquantized checkpoint."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.model.quant.weights import PackedWeights

_CONFIG = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, tie_word_embeddings=False)
_ARCHS = {  # MoE: every expert's projections quantized, routers dense
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {
        "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128}),
    # latent attention (kv_b_proj read whole), RoPE rows reordered, experts and a shared one
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32, "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16, "v_head_dim": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 64, "n_shared_experts": 1, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1, "pad_token_id": 0}),
}
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "w1", "w2", "w3", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
_SHARED_INPUT = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj", "w3": "w1"}
_AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def _int32(words: torch.Tensor) -> torch.Tensor:
    words = words & 0xFFFFFFFF
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _pack_rows(q: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] codes -> int32 [R * bits / 32, C], lowest bits first (GPTQ qweight)."""
    per = 32 // bits
    q = q.long().reshape(-1, per, q.shape[1])
    return _int32(sum(q[:, j] << (bits * j) for j in range(per)))


def _pack_cols(q: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] codes -> int32 [R, C * bits / 32]; word nibble j holds column order[j] of its pack."""
    per = 32 // bits
    order = order or list(range(per))
    q = q.long().reshape(q.shape[0], -1, per)
    return _int32(sum(q[..., order[j]] << (bits * j) for j in range(per)))


def _gptq_layer(w, bits, group, sym, perm, fmt):
    """w [N, K] -> (checkpoint tensors, dequantized w). Input perm[j] is in group j // group."""
    n, k = w.shape
    group = k if group == -1 else group  # -1: per channel, one group spans the inputs
    g = torch.Generator().manual_seed(n * k + bits)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group
    top = (1 << bits) - 1
    scales = (torch.rand(k // group, n, generator=g) * 0.02 + 0.005).half().float()
    if sym:
        zeros = torch.full((k // group, n), 1 << (bits - 1))
    else:  # zero 0 would wrap in GPTQ v1's zero - 1 storage; real quantizers avoid it too
        zeros = torch.randint(1, top, (k // group, n), generator=g)
    s, z = scales[g_idx.long()], zeros[g_idx.long()].float()  # [K, N] per input
    q = (w.t() / s + z).round().clamp(0, top)
    deq = (s * (q - z)).t()
    if fmt == "awq":
        tensors = {"qweight": _pack_cols(q, 4, _AWQ_ORDER), "qzeros": _pack_cols(zeros, 4, _AWQ_ORDER),
                   "scales": scales.half()}
    else:
        tensors = {"qweight": _pack_rows(q, bits), "qzeros": _pack_cols(zeros - 1, bits),
                   "scales": scales.half(), "g_idx": g_idx}
    return tensors, deq


def _fp8_layer(w, per_channel, block=None):
    if block:  # a scale per [block, block] tile (DeepSeek V3's checkpoints: 128)
        n, k = w.shape
        tiles = w.reshape(n // block, block, k // block, block)
        scale = (tiles.abs().amax((1, 3)) / 448).float()  # [n / b, k / b]
        full = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)
        q = (w / full).to(torch.float8_e4m3fn)
        return {"weight": q, "weight_scale_inv": scale}, q.float() * full
    amax = w.abs().amax(1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / 448).float()
    q = (w / scale).to(torch.float8_e4m3fn)
    return ({"weight": q, "weight_scale": scale if per_channel else scale.reshape(1)},
            q.float() * scale)


def _nvfp4_layer(w):
    from octavo.model.quant.microscaled import (FP4_VALUES, MicroscaledPacked, e4m3_table,
                                                quantize_nvfp4)

    t = quantize_nvfp4(w)
    packed = MicroscaledPacked(t["weight_packed"], t["weight_scale"].view(torch.uint8),
                               torch.tensor(FP4_VALUES),
                               e4m3_table() / t["weight_global_scale"], 16, torch.float32)
    return t, packed.reference()


def _modelopt_layer(w, algo):
    from octavo.model.quant.microscaled import (FP4_VALUES, MicroscaledPacked, e4m3_table,
                                                e8m0_table, quantize_mxfp8, quantize_nvfp4)

    if algo == "MXFP8":
        codes, scales = quantize_mxfp8(w)
        packed = MicroscaledPacked(codes.view(torch.uint8), scales, e4m3_table(), e8m0_table(),
                                   32, torch.float32)
        return {"weight": codes, "weight_scale": scales}, packed.reference()
    t = quantize_nvfp4(w)  # ModelOpt's global scale multiplies: the reciprocal of this one
    layer = {"weight": t["weight_packed"], "weight_scale": t["weight_scale"],
             "weight_scale_2": 1.0 / t["weight_global_scale"], "input_scale": torch.ones(1)}
    packed = MicroscaledPacked(t["weight_packed"], t["weight_scale"].view(torch.uint8),
                               torch.tensor(FP4_VALUES),
                               e4m3_table() / t["weight_global_scale"], 16, torch.float32)
    return layer, packed.reference()


def _random_model(arch):
    import transformers

    config_cls, model_cls, extra = _ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, config_cls)(**{**_CONFIG, **extra})
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.08) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    return model


def _save_dense(model, folder, tokenizer_folder):
    model.save_pretrained(folder)  # transformers writes per-expert tensors (experts.0.w1...)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / f, folder / f)


def _build(tmp_path, tokenizer_folder, fmt, qconfig, arch="llama", **kw):
    """(quantized checkpoint folder, transformers model on its dequantized weights)."""
    from transformers import AutoModelForCausalLM

    dense = tmp_path / "dense"
    _save_dense(_random_model(arch), dense, tokenizer_folder)
    tensors = load_file(dense / "model.safetensors")
    quantized, perms, replaced = {}, {}, set()
    for name in list(tensors):
        module, _, kind = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf not in _PROJ or kind != "weight":
            continue
        w = tensors.pop(name)
        key = (parent, _SHARED_INPUT.get(leaf, leaf))  # q/k/v and gate/up share their input
        perms.setdefault(key, torch.randperm(w.shape[1]) if kw.get("desc_act")
                         else torch.arange(w.shape[1]))
        if fmt == "fp8":
            layer, deq = _fp8_layer(w, kw["per_channel"], kw.get("block"))
        elif fmt == "nvfp4":
            layer, deq = _nvfp4_layer(w)
        elif fmt == "modelopt":
            layer, deq = _modelopt_layer(w, kw["algo"])
        else:
            layer, deq = _gptq_layer(w, kw["bits"], kw["group"], kw["sym"], perms[key], fmt)
        tensors[name] = deq.contiguous()  # the oracle's dequantized weight
        replaced.add(name)
        quantized.update({f"{module}.{t}": v.contiguous() for t, v in layer.items()})
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(dense / f, folder / f)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (folder / "config.json").write_text(json.dumps(cfg))
    kept = {k: v for k, v in tensors.items() if k not in replaced}
    save_file({**kept, **quantized}, str(folder / "model.safetensors"))
    save_file(tensors, str(dense / "model.safetensors"))
    return folder, AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()


def _compare(folder, ref, atol=1e-4, **llm_kw):
    prompt = torch.randint(100, 49000, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        ref_lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20, **llm_kw)
    out = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[p][prompt[p]].logprob for p in range(1, len(prompt))])
    theirs = ref_lp[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
    assert torch.allclose(ours, theirs, atol=atol), (ours - theirs).abs().max()
    return llm


GPTQ_CASES = {
    "gptq-4bit-sym": dict(bits=4, group=32, sym=True, desc_act=False),
    "gptq-4bit-asym-act-order": dict(bits=4, group=64, sym=False, desc_act=True),
    "gptq-4bit-per-channel": dict(bits=4, group=-1, sym=False, desc_act=False),
    "gptq-8bit-sym-act-order": dict(bits=8, group=32, sym=True, desc_act=True),
    "gptq-8bit-asym": dict(bits=8, group=128, sym=False, desc_act=False),
}


GPTQ_MOE = {"mixtral-gptq-4bit-act-order": ("mixtral", "gptq-4bit-asym-act-order"),
            "qwen2-moe-gptq-8bit": ("qwen2-moe", "gptq-8bit-asym")}


@pytest.mark.parametrize("name", list(GPTQ_CASES) + list(GPTQ_MOE))
def test_gptq_checkpoint_matches_dequantized_model(tmp_path, smollm_oracle_folder, name):
    arch, case = GPTQ_MOE.get(name, ("llama", name))
    kw = GPTQ_CASES[case]
    qc = {"quant_method": "gptq", "bits": kw["bits"], "group_size": kw["group"],
          "desc_act": kw["desc_act"], "sym": kw["sym"], "checkpoint_format": "gptq"}
    folder, ref = _build(tmp_path, smollm_oracle_folder, "gptq", qc, arch, **kw)
    _assert_packed(_compare(folder, ref), arch)


def _assert_packed(llm, arch):
    """The packed weights replace the dense ones (experts too)."""
    layer = llm.engine.client.core.executor.worker.runner.model.model.layers[0]
    if arch == "llama":
        assert isinstance(layer.mlp.gate_up_proj.weights, PackedWeights)
        assert "weight" not in dict(layer.mlp.gate_up_proj.named_parameters())
    else:
        moe = getattr(layer, "block_sparse_moe", None) or layer.mlp
        assert moe.experts.expert_linears is not None and not hasattr(moe.experts, "w13")
        assert isinstance(moe.experts.expert_linears[0][0].weights, PackedWeights)


def test_awq_checkpoint_matches_dequantized_model(tmp_path, smollm_oracle_folder):
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
          "version": "gemm"}
    folder, ref = _build(tmp_path, smollm_oracle_folder, "awq", qc, bits=4, group=32, sym=False)
    _compare(folder, ref)


@pytest.mark.parametrize("fmt,per_channel,block", [("fp8", False, None), ("fp8", False, 32),
                                                   ("compressed-tensors", True, None)])
def test_fp8_checkpoint_matches_dequantized_model(tmp_path, smollm_oracle_folder, fmt,
                                                  per_channel, block):
    """Per tensor, per [32, 32] block and per channel: the weights stay FP8 (a byte each, with
    a float32 scale per row and block) and the model equals transformers on the dequantized
    ones."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic"} if fmt == "fp8" else {
        "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
            "num_bits": 8, "type": "float", "strategy": "channel"}}}}
    if block:
        qc["weight_block_size"] = [block, block]
    folder, ref = _build(tmp_path, smollm_oracle_folder, "fp8", qc, per_channel=per_channel,
                         block=block)
    llm = _compare(folder, ref)
    _assert_packed(llm, "llama")
    packed = llm.engine.client.core.executor.worker.runner.model.model.layers[0].mlp \
        .gate_up_proj.weights.packed
    assert packed.codes.dtype == torch.uint8 and packed.codes.numel() == packed.out_features \
        * packed.in_features  # a byte a weight


def test_deepseek_fp8_block_checkpoint_matches_dequantized_model(tmp_path,
                                                                 smollm_oracle_folder):
    """DeepSeek V3's own format: every projection FP8 with a scale per [16, 16] block (the
    release's 128). kv_b_proj, which the latent attention reads whole, is decoded as it is
    read; the rest stays FP8, the q and kv_a rows reordered for RoPE within their scale
    blocks. Equal to transformers on the dequantized weights."""
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    folder, ref = _build(tmp_path, smollm_oracle_folder, "fp8", qc, "deepseek-v3",
                         per_channel=False, block=16)
    llm = _compare(folder, ref)
    attn = llm.engine.client.core.executor.worker.runner.model.model.layers[1].self_attn
    assert isinstance(attn.q_b_proj.weights, PackedWeights)
    assert attn.kv_b_proj.weight.dtype == torch.float32


def test_nvfp4_checkpoint_keeps_its_codes_and_matches_dequantized_model(tmp_path,
                                                                         smollm_oracle_folder):
    """compressed-tensors' NVFP4 (e2m1 codes, e4m3 scales per 16, a global scale per layer, q/k/v
    quantized apart): the codes stay packed (half a byte a weight) and the model equals
    transformers on the dequantized weights."""
    qc = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
          "ignore": ["lm_head"], "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
              "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16}}}}
    folder, ref = _build(tmp_path, smollm_oracle_folder, "nvfp4", qc)
    llm = _compare(folder, ref)
    _assert_packed(llm, "llama")
    attn = llm.engine.client.core.executor.worker.runner.model.model.layers[0].self_attn
    packed = attn.qkv_proj.weights.packed
    assert packed.codes.numel() * 2 == packed.out_features * packed.in_features
    assert packed.scales.dtype == torch.float32  # q, k and v scaled apart: float scales
    down = llm.engine.client.core.executor.worker.runner.model.model.layers[0].mlp.down_proj
    assert down.weights.packed.scales.dtype == torch.uint8  # one global scale: its bytes


@pytest.mark.parametrize("algo", ["NVFP4", "MXFP8"])
def test_modelopt_checkpoint_keeps_its_codes_and_matches_dequantized_model(
        tmp_path, smollm_oracle_folder, algo):
    """ModelOpt's NVFP4 (global scales that multiply, named in hf_quant_config.json, with
    input scales and KV-cache scales on k_proj / v_proj) and MXFP8 (e4m3 codes, e8m0 scales per
    32, named in config.json): kept packed, equal to transformers on the dequantized
    weights."""
    qc = {"quant_method": "modelopt", "quant_algo": algo, "exclude_modules": ["lm_head"]}
    folder, ref = _build(tmp_path, smollm_oracle_folder, "modelopt", qc, algo=algo)
    if algo == "NVFP4":  # the older export: hf_quant_config.json, not config.json
        cfg = json.loads((folder / "config.json").read_text())
        del cfg["quantization_config"]
        (folder / "config.json").write_text(json.dumps(cfg))
        (folder / "hf_quant_config.json").write_text(json.dumps({"producer": {
            "name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                  "kv_cache_quant_algo": "FP8"}}))
        tensors = load_file(folder / "model.safetensors")
        for i in range(_CONFIG["num_hidden_layers"]):
            for kv in "kv":
                tensors[f"model.layers.{i}.self_attn.{kv}_proj.{kv}_scale"] = torch.tensor(0.5)
        save_file(tensors, str(folder / "model.safetensors"))
    llm = _compare(folder, ref)
    _assert_packed(llm, "llama")
    layer = llm.engine.client.core.executor.worker.runner.model.model.layers[0]
    packed = layer.mlp.down_proj.weights.packed
    assert packed.codes.numel() * (2 if algo == "NVFP4" else 1) == packed.out_features * \
        packed.in_features
    if algo == "NVFP4":
        assert layer.self_attn.attn.k_scale == layer.self_attn.attn.v_scale == 0.5


def test_quantization_flag_on_a_quantized_checkpoint_names_the_field(tmp_path,
                                                                    smollm_oracle_folder):
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    folder, _ = _build(tmp_path, smollm_oracle_folder, "awq", qc, bits=4, group=32, sym=False)
    with pytest.raises(ValueError, match="quantization='int8'.*already quantized"):
        LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20,
            quantization="int8")


def test_unsupported_formats_name_themselves(tmp_path, smollm_oracle_folder):
    qc = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemv"}
    folder, _ = _build(tmp_path, smollm_oracle_folder, "awq", qc, bits=4, group=32, sym=False)
    with pytest.raises(NotImplementedError, match="version='gemv'"):
        LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20)


def _fake_quant(w: torch.Tensor, mode: str) -> torch.Tensor:
    """What --quantization promises, computed here independently: int8 symmetric per channel,
    int4 min/max per 32 inputs (the minimum exact), fp8 e4m3 per channel."""
    if mode == "int8":
        s = w.abs().amax(1, keepdim=True) / 127
        return (w / s).round().clamp(-127, 127) * s
    if mode == "fp8":
        s = w.abs().amax(1, keepdim=True) / 448
        return (w / s).to(torch.float8_e4m3fn).float() * s
    g = w.reshape(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = (hi - lo) / 15
    return (((g - lo) / s).round().clamp(0, 15) * s + lo).reshape(w.shape)


@pytest.mark.parametrize("mode,arch", [("int8", "llama"), ("int4", "llama"), ("fp8", "llama"),
                                       ("int4", "mixtral"), ("int8", "qwen2-moe")])
def test_quantization_at_load_matches_fake_quantized_model(tmp_path, smollm_oracle_folder, mode,
                                                           arch):
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "dense"
    _save_dense(_random_model(arch), folder, smollm_oracle_folder)
    tensors = load_file(folder / "model.safetensors")
    for name, w in tensors.items():
        if name.rpartition(".")[0].rpartition(".")[2] in _PROJ and name.endswith(".weight"):
            tensors[name] = _fake_quant(w, mode)
    oracle = tmp_path / "oracle"
    shutil.copytree(folder, oracle)
    save_file(tensors, str(oracle / "model.safetensors"))
    ref = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    llm = _compare(folder, ref, atol=2e-4, quantization=mode)
    _assert_packed(llm, arch)


def test_moe_routers_stay_dense_under_quantization_at_load(tmp_path, smollm_oracle_folder):
    """gpt-oss's router (mlp.router) picks the experts: --quantization int8 packs its experts
    and attention, not the router; and a latent-attention layer refuses fp8 k/v cache scales
    (its one cache row is both K and V)."""
    from octavo.model.quant.weights import DenseWeights
    from tests.parity.test_tiny_models import _build as build_tiny

    folder, _ = build_tiny(tmp_path, smollm_oracle_folder, "gpt-oss")
    llm = LLM(str(folder), dtype="float32", max_model_len=128, kv_cache_memory=8 << 20,
              quantization="int8")
    mlp = llm.engine.client.core.executor.worker.runner.model.model.layers[0].mlp
    assert isinstance(mlp.router.weights, DenseWeights)
    assert isinstance(mlp.experts.expert_linears[0][0].weights, PackedWeights)
    from octavo.model.layers.attention import PagedAttention

    latent = PagedAttention(0, 4, 1, 48, scale=1.0, shared_kv=True)
    with pytest.raises(NotImplementedError, match="both K and V"):
        latent.set_kv_scale("k_scale", torch.tensor(0.5))
