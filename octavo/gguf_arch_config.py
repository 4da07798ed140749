"""An ArchConfig from a GGUF's metadata and tensor list (llama.cpp's keys and layouts, per
architecture), for arch_config.read_arch_config, which caches it."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from octavo.arch_config import CHUNKED, FULL, LINEAR, SLIDING, ArchConfig
from octavo.model_files import open_gguf
from octavo.model_source import ModelSource

# GGUF `general.architecture` -> the Hugging Face architecture name octavo registers it under.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gptneox": "GPTNeoXForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "command-r": "CohereForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "llama4": "Llama4ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",  # V3's when the file has its score correction
    "qwen3next": "Qwen3NextForCausalLM",
}
# ... and the one it registers under when the file holds stacked expert tensors.
GGUF_EXPERT_ARCHITECTURES = {"llama": "MixtralForCausalLM"}


def from_gguf(source: ModelSource) -> ArchConfig:
    reader = open_gguf(source.path)  # a truncated or corrupt file: a ValueError naming it
    meta = reader.metadata
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise NotImplementedError(
            f"GGUF architecture {arch!r} is not supported yet; supported: "
            f"{', '.join(GGUF_ARCHITECTURES)}, and llama with expert tensors (Mixtral)")
    tensors = {t.name: t for t in reader.tensors}

    def need(key: str) -> Any:
        if meta.get(f"{arch}.{key}") is None:
            raise ValueError(f"model: {source.path} lacks the GGUF key {arch}.{key}")
        return meta[f"{arch}.{key}"]

    embd = tensors.get("token_embd.weight")
    vocab = meta.get(f"{arch}.vocab_size") or (int(embd.shape[-1]) if embd is not None else None)
    if vocab is None:
        raise ValueError(f"model: {source.path} has neither {arch}.vocab_size nor token_embd")
    hidden = need("embedding_length")
    heads = need("attention.head_count")
    num_layers = need("block_count")
    head_dim = meta.get(f"{arch}.attention.key_length", hidden // heads)
    rope_dims = meta.get(f"{arch}.rope.dimension_count")
    cfg: dict[str, Any] = dict(
        architecture=GGUF_ARCHITECTURES[arch],
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=need("feed_forward_length"),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=meta.get(f"{arch}.attention.head_count_kv", heads),
        head_dim=head_dim,
        max_position_embeddings=meta.get(f"{arch}.context_length", 2048),
        rms_norm_eps=meta.get(f"{arch}.attention.layer_norm_rms_epsilon",
                              meta.get(f"{arch}.attention.layer_norm_epsilon", 1e-6)),
        rope_theta=meta.get(f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=_gguf_rope_scaling(source, arch, meta, tensors),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors or "blk.0.attn_qkv.bias" in tensors,
        rotary_dim=rope_dims if rope_dims and rope_dims != head_dim else None,
        gguf_arch=arch,
    )
    if arch in ("gemma2", "gemma3"):
        # GGUF keeps no layer pattern, local RoPE base or query scalar: llama.cpp hard-codes them
        # per architecture, and so does this.
        every = 2 if arch == "gemma2" else 6
        cfg.update(
            hidden_act="gelu_pytorch_tanh",
            sliding_window=meta.get(f"{arch}.attention.sliding_window"),
            layer_types=tuple(SLIDING if (i + 1) % every else FULL for i in range(num_layers)),
            # The 27B models (46 or 62 layers) scale by hidden / heads, the others by head_dim.
            query_pre_attn_scalar=hidden // heads if num_layers in (46, 62) else head_dim,
            attn_logit_softcap=meta.get(f"{arch}.attn_logit_softcapping"),
            final_logit_softcap=meta.get(f"{arch}.final_logit_softcapping"),
            rope_local_theta=10000.0 if arch == "gemma3" else None)
    elif arch == "phi3":
        cfg["sliding_window"] = meta.get(f"{arch}.attention.sliding_window") or None
    elif arch == "gptneox":  # the activations are the Hugging Face defaults; GGUF names none
        cfg.update(hidden_act="gelu", extra={
            "use_parallel_residual": meta.get(f"{arch}.use_parallel_residual", True)})
    elif arch == "granite":  # the Hugging Face names of its four scales
        cfg["extra"] = {hf: meta[f"{arch}.{key}"] for hf, key in (
            ("embedding_multiplier", "embedding_scale"), ("residual_multiplier", "residual_scale"),
            ("attention_multiplier", "attention.scale"), ("logits_scaling", "logit_scale"))
            if meta.get(f"{arch}.{key}") is not None}
    elif arch == "starcoder2":
        cfg.update(hidden_act="gelu_pytorch_tanh",
                   extra={"use_bias": "blk.0.attn_q.bias" in tensors})
    elif arch == "command-r":
        cfg["extra"] = {"logit_scale": meta.get(f"{arch}.logit_scale", 1.0),
                        "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors}
    elif arch == "glm4":  # RoPE on rope.dimension_count features (half of a head by default)
        cfg["extra"] = {"partial_rotary_factor": (rope_dims or head_dim // 2) / head_dim}
    elif arch == "gpt-oss":  # sliding and full layers alternate, as llama.cpp hard-codes
        cfg.update(
            intermediate_size=need("expert_feed_forward_length"),
            sliding_window=need("attention.sliding_window"),
            layer_types=tuple(SLIDING if i % 2 == 0 else FULL for i in range(num_layers)),
            extra={"num_local_experts": need("expert_count"),
                   "num_experts_per_tok": need("expert_used_count")})
        if cfg["rope_scaling"] is not None:  # gpt-oss's YaRN keeps its correction range whole
            cfg["rope_scaling"] = {**cfg["rope_scaling"], "truncate": False}
    elif arch == "llama4":
        cfg.update(_gguf_llama4(meta, num_layers, need))
    elif arch == "deepseek2":
        cfg.update(_gguf_deepseek2(meta, tensors, cfg, need))
    elif arch == "qwen3next":
        cfg.update(_gguf_qwen3next(tensors, num_layers, need))
    elif arch == "gpt2":
        pos = tensors.get("position_embd.weight")
        if pos is None:
            raise ValueError(f"model: {source.path} (gpt2) lacks the tensor position_embd.weight")
        cfg.update(hidden_act="gelu_new", max_position_embeddings=int(pos.shape[1]))
    if arch in GGUF_EXPERT_ARCHITECTURES and "blk.0.ffn_gate_exps.weight" in tensors:
        cfg["architecture"] = GGUF_EXPERT_ARCHITECTURES[arch]
    if arch in ("qwen2moe", "qwen3moe", "qwen3next") or \
            cfg["architecture"] == "MixtralForCausalLM":
        cfg["extra"] = {**cfg.get("extra", {}), **_gguf_experts(arch, meta, tensors, need)}
    return ArchConfig(**cfg)


def _gguf_llama4(meta: dict[str, Any], num_layers: int,
                 need: Callable[[str], Any]) -> dict[str, Any]:
    """Llama 4's settings as llama.cpp reads them: chunks of 8192 tokens and a layer without
    RoPE (over the whole context, its query temperature at floor 8192, scale 0.1) every
    fourth are hard-coded there, as are q/k norms on all but the 128-expert model (Maverick);
    a sliding window of 0 in the file turns chunks off and RoPE on everywhere."""
    experts = need("expert_count")
    chunked = meta.get("llama4.attention.sliding_window") != 0
    rope = [int(not chunked or (i + 1) % 4 != 0) for i in range(num_layers)]
    return dict(
        intermediate_size=need("expert_feed_forward_length"),
        layer_types=tuple(CHUNKED if r and chunked else FULL for r in rope),
        attention_chunk_size=8192 if chunked else None,
        extra={"intermediate_size_mlp": need("feed_forward_length"),
               "num_local_experts": experts, "num_experts_per_tok": need("expert_used_count"),
               "interleave_moe_layer_step": need("interleave_moe_layer_step"),
               "use_qk_norm": experts != 128, "no_rope_layers": rope, "floor_scale": 8192,
               "attn_scale": 0.1})


def _gguf_deepseek2(meta: dict[str, Any], tensors: dict[str, Any], cfg: dict[str, Any],
                    need: Callable[[str], Any]) -> dict[str, Any]:
    """DeepSeek V2/V3 as llama.cpp writes them: the latent attention as one KV head of
    kv_lora_rank + rope features (key_length), the heads' own sizes as key_length_mla and
    value_length_mla (older files: key_length and value_length), V3 told by its score
    correction (exp_probs_b), YaRN's mscale as yarn_log_multiplier / 0.1."""
    a = "deepseek2"
    rope = need("rope.dimension_count")
    key = meta.get(f"{a}.attention.key_length_mla") or need("attention.key_length")
    value = meta.get(f"{a}.attention.value_length_mla") or need("attention.value_length")
    v3 = any(n.endswith(".exp_probs_b.bias") for n in tensors)
    groups = meta.get(f"{a}.expert_group_count") or 1
    extra = {"kv_lora_rank": need("attention.kv_lora_rank"),
             "q_lora_rank": meta.get(f"{a}.attention.q_lora_rank"),
             "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value,
             "n_routed_experts": need("expert_count"),
             "num_experts_per_tok": need("expert_used_count"),
             "moe_intermediate_size": need("expert_feed_forward_length"),
             "n_shared_experts": meta.get(f"{a}.expert_shared_count") or 0,
             "first_k_dense_replace": meta.get(f"{a}.leading_dense_block_count") or 0,
             "routed_scaling_factor": meta.get(f"{a}.expert_weights_scale") or 1.0,
             "norm_topk_prob": bool(meta.get(f"{a}.expert_weights_norm")),
             "n_group": groups, "topk_group": meta.get(f"{a}.expert_group_used_count") or 1,
             "topk_method": "group_limited_greedy" if groups > 1 and not v3 else "greedy"}
    scaling = cfg["rope_scaling"]
    log_mul = meta.get(f"{a}.rope.scaling.yarn_log_multiplier")
    if scaling is not None and log_mul:
        scaling = {**scaling, "mscale": log_mul / 0.1, "mscale_all_dim": log_mul / 0.1}
    return dict(architecture="DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM",
                num_kv_heads=cfg["num_heads"], head_dim=key, rotary_dim=None,
                rope_scaling=scaling, extra=extra)


def _gguf_qwen3next(tensors: dict[str, Any], num_layers: int,
                    need: Callable[[str], Any]) -> dict[str, Any]:
    """Qwen3-Next as llama.cpp writes it: the linear layers' sizes as ssm.* keys (state_size is
    a key head's width, group_count the key heads, time_step_rank the value heads, inner_size
    all value features), full attention every full_attention_interval-th layer, and dense
    layers where a layer has no router. Newer converters split the linear layers' projection
    into q | k | v of all heads (attn_qkv) and z (attn_gate); older ones keep Hugging Face's
    grouped in_proj_qkvz (ssm_in): `linear_qkvz_split` tells GatedDeltaNet which it reads."""
    every = need("full_attention_interval")
    v_heads = need("ssm.time_step_rank")
    return dict(
        layer_types=tuple(LINEAR if (i + 1) % every else FULL for i in range(num_layers)),
        extra={"linear_conv_kernel_dim": need("ssm.conv_kernel"),
               "linear_key_head_dim": need("ssm.state_size"),
               "linear_num_key_heads": need("ssm.group_count"),
               "linear_num_value_heads": v_heads,
               "linear_value_head_dim": need("ssm.inner_size") // v_heads,
               "linear_qkvz_split": any(n.endswith(".attn_gate.weight") for n in tensors),
               "mlp_only_layers": [i for i in range(num_layers)
                                   if f"blk.{i}.ffn_gate_inp.weight" not in tensors]})


def _gguf_experts(arch: str, meta: dict[str, Any], tensors: dict[str, Any],
                  need: Callable[[str], Any]) -> dict[str, Any]:
    """The MoE settings under the names the Hugging Face configs (and octavo's MoE file) use."""
    def rows(name: str) -> int | None:  # output features: a GGUF shape lists the input first
        t = tensors.get(name)
        return int(t.shape[1]) if t is not None else None

    extra: dict[str, Any] = {
        "num_experts": need("expert_count"),
        "num_experts_per_tok": need("expert_used_count"),
        # llama.cpp renormalizes the top-k weights of Mixtral and Qwen3-MoE, not of Qwen2-MoE.
        "norm_topk_prob": meta.get(f"{arch}.expert_weights_norm", arch != "qwen2moe"),
    }
    # Older files lack the width keys; the tensors' shapes tell them as well.
    extra["moe_intermediate_size"] = (meta.get(f"{arch}.expert_feed_forward_length")
                                      or rows("blk.0.ffn_gate_exps.weight")
                                      or need("expert_feed_forward_length"))
    if arch in ("qwen2moe", "qwen3next"):
        extra["shared_expert_intermediate_size"] = (
            meta.get(f"{arch}.expert_shared_feed_forward_length")
            or rows("blk.0.ffn_gate_shexp.weight") or need("expert_shared_feed_forward_length"))
    return extra


def _gguf_rope_scaling(source: ModelSource, arch: str, meta: dict[str, Any],
                       tensors: dict[str, Any]) -> dict[str, Any] | None:
    """RoPE scaling from metadata, or from the per-frequency factors llama.cpp's converter stores
    as tensors: rope_freqs (Llama 3.1+: the llama3 scaling, already evaluated) and
    rope_factors_long/short (Phi-3's longrope)."""
    def factors(name: str) -> list[float]:
        t = tensors.get(name)
        if t is None:
            raise ValueError(f"model: {source.path} lacks the tensor {name}")
        if t.tensor_type.name not in ("F32", "F16"):
            raise ValueError(f"model: {source.path}: {name} must be F32 or F16, "
                             f"got {t.tensor_type.name}")
        return [float(x) for x in t.data.reshape(-1)]

    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if "rope_freqs.weight" in tensors:
        if kind not in ("none", "llama3"):
            raise NotImplementedError(f"GGUF rope_freqs together with rope scaling {kind!r}")
        return {"rope_type": "freq_factors", "freq_factors": factors("rope_freqs.weight")}
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if "rope_factors_long.weight" in tensors:
        if original is None:
            raise ValueError(f"model: {source.path} has rope_factors_long but no "
                             f"{arch}.rope.scaling.original_context_length")
        return {"rope_type": "longrope", "original_max_position_embeddings": original,
                "long_factor": factors("rope_factors_long.weight"),
                "short_factor": factors("rope_factors_short.weight"),
                "attention_factor": meta.get(f"{arch}.rope.scaling.attn_factor")}
    if kind == "none":
        return None
    scaling = {"rope_type": kind, "factor": meta.get(f"{arch}.rope.scaling.factor", 1.0),
               "original_max_position_embeddings": original}
    for hf, key in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        if meta.get(f"{arch}.rope.scaling.{key}") is not None:
            scaling[hf] = meta[f"{arch}.rope.scaling.{key}"]
    return scaling
