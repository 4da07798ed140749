"""A small Hugging Face -> GGUF converter for the tiny test models.

It lays tensors and metadata out the way llama.cpp's converter does, taking tensor names from the
gguf package's own TensorNameMap (so octavo's loader is checked against the names real files
use, not against its own table): q/k rows permuted for the llama and granite architectures,
their scales as Granite's and Cohere's keys, Gemma's and Qwen3-Next's norms stored as 1 + w,
Qwen3-Next's linear layers as _qwen3next_linear describes, GPT-2's Conv1D weights transposed
to [out, in] and its head written as a copy of the embedding, GPT-NeoX's per-head q/k/v
regrouped into q | k | v, MoE experts stacked per projection (gpt-oss's gate and up columns
split), the shared-expert gate as a vector, and RoPE factors as tensors (rope_freqs for Llama 3
scaling, rope_factors_long/short for Phi-3's longrope) or keys (YaRN).
"""
from __future__ import annotations

import math

import gguf
import gguf.quants
import numpy as np

_ARCHS = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3,
          "gemma3": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3,
          "gptneox": gguf.MODEL_ARCH.GPTNEOX, "gpt2": gguf.MODEL_ARCH.GPT2,
          "qwen2moe": gguf.MODEL_ARCH.QWEN2MOE, "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
          "granite": gguf.MODEL_ARCH.GRANITE, "olmo2": gguf.MODEL_ARCH.OLMO2,
          "starcoder2": gguf.MODEL_ARCH.STARCODER2, "command-r": gguf.MODEL_ARCH.COMMAND_R,
          "glm4": gguf.MODEL_ARCH.GLM4, "gpt-oss": gguf.MODEL_ARCH.GPT_OSS,
          "llama4": gguf.MODEL_ARCH.LLAMA4, "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
          "qwen3next": gguf.MODEL_ARCH.QWEN3NEXT}
# llama.cpp's converter permutes q/k rows for these (its LlamaModel and subclasses); Cohere and
# GLM-4 rotate adjacent pairs in Hugging Face's layout already, which llama.cpp reads as it is.
_INTERLEAVED = ("llama", "granite")
# LayerNorm families: llama.cpp writes layer_norm_epsilon, not the RMS one
_LAYER_NORM = ("gptneox", "gpt2", "starcoder2", "command-r")
_SKIP = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")


def _interleave(w: np.ndarray, heads: int) -> np.ndarray:
    """Rotate-half rows -> the interleaved pairs llama.cpp's llama RoPE reads."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """Per frequency, how much Llama 3 scaling divides it (what llama.cpp stores as rope_freqs)."""
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    out = []
    for wavelen in 2 * math.pi / inv_freq:
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def _metadata(w: gguf.GGUFWriter, arch: str, c, head_dim: int) -> None:
    gpt2 = arch == "gpt2"
    w.add_context_length(c.n_positions if gpt2 else c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.n_inner or 4 * c.n_embd if gpt2 else
                              getattr(c, "intermediate_size_mlp", None) or c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    if arch in ("gptneox", "gpt2"):
        w.add_layer_norm_eps(c.layer_norm_epsilon if gpt2 else c.layer_norm_eps)
    elif arch == "deepseek2":
        _deepseek2_metadata(w, c)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
    if arch in ("starcoder2", "command-r"):
        w.add_layer_norm_eps(getattr(c, "norm_epsilon", None) or c.layer_norm_eps)
    elif arch not in _LAYER_NORM:
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if arch == "granite":
        w.add_embedding_scale(c.embedding_multiplier)
        w.add_residual_scale(c.residual_multiplier)
        w.add_attention_scale(c.attention_multiplier)
        w.add_logit_scale(c.logits_scaling)
    elif arch == "command-r":
        w.add_logit_scale(c.logit_scale)
    if getattr(c, "head_dim", None) and arch != "deepseek2":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    rope = getattr(c, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3's base is its global layers'
    if "rope_theta" in rope:
        w.add_rope_freq_base(rope["rope_theta"])
    if rope.get("partial_rotary_factor", 1.0) != 1.0 and arch != "deepseek2":
        w.add_rope_dimension_count(int(rope["partial_rotary_factor"] * head_dim))
    if arch in ("gemma3", "phi3", "gpt-oss") and c.sliding_window:
        w.add_sliding_window(c.sliding_window)
    if arch in ("gpt-oss", "llama4"):  # its experts' width; YaRN as llama.cpp writes it
        w.add_expert_feed_forward_length(c.intermediate_size)
    if arch == "llama4":
        w.add_interleave_moe_layer_step(c.interleave_moe_layer_step)
    if arch == "qwen3next":  # the linear layers' sizes as llama.cpp's ssm keys
        w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
        w.add_ssm_state_size(c.linear_key_head_dim)
        w.add_ssm_group_count(c.linear_num_key_heads)
        w.add_ssm_time_step_rank(c.linear_num_value_heads)
        w.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
        w.add_full_attention_interval(c.full_attention_interval)
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32.0))
        w.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1.0))
    if arch == "gptneox":
        w.add_parallel_residual(c.use_parallel_residual)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    if getattr(c, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if getattr(c, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    if rope.get("rope_type") == "longrope":
        orig = c.original_max_position_embeddings
        w.add_rope_scaling_orig_ctx_len(orig)
        scale = c.max_position_embeddings / orig
        w.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0)


def _tensors(arch: str, model, split_qkvz: bool = True) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, in llama.cpp's layouts (Qwen3-Next's linear
    projection split as newer converters write it, or whole as older ones did)."""
    c = model.config
    names = gguf.get_tensor_name_map(_ARCHS[arch], c.num_hidden_layers)
    heads, kv_heads = c.num_attention_heads, getattr(c, "num_key_value_heads", None)
    out: dict[str, np.ndarray] = {}
    for name, t in model.state_dict().items():
        t = t.float().numpy()
        if name.endswith(_SKIP) or (name == "lm_head.weight" and c.tie_word_embeddings):
            continue
        if arch == "gpt-oss" and "mlp.experts." in name:  # [E, in, out]; gate, up interleaved
            parts = _gpt_oss_experts(name, t)
        elif arch == "llama4" and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t = t.transpose(0, 2, 1)  # [E, in, out] -> [E, out, in]; gate rows, then up rows
            half = t.shape[1] // 2
            parts = ({name + ".weight": t} if name.endswith("down_proj") else {
                name.replace("gate_up_proj", "gate_proj.weight"): t[:, :half],
                name.replace("gate_up_proj", "up_proj.weight"): t[:, half:]})
        elif arch == "deepseek2" and name.endswith(("kv_b_proj.weight",
                                                    "e_score_correction_bias")):
            parts = _deepseek2_tensor(name, t, c)
        elif arch == "qwen3next" and ".linear_attn." in name:
            parts = _qwen3next_linear(name, t, c, split_qkvz)
        elif name.endswith("self_attn.sinks"):
            parts = {name + ".weight": t}
        elif name.endswith("experts.down_proj"):  # [E, H, I], stacked as in the GGUF
            parts = {name + ".weight": t}
        elif name.endswith("experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            half = t.shape[1] // 2
            parts = {name.replace("gate_up_proj", "gate_proj.weight"): t[:, :half],
                     name.replace("gate_up_proj", "up_proj.weight"): t[:, half:]}
        else:
            parts = {name: t}
        for hf, t in parts.items():
            gname = names.get_name(hf, try_suffixes=(".weight", ".bias"))
            if gname is None:
                raise KeyError(f"gguf has no name for {hf} ({arch})")
            if arch in _INTERLEAVED and gname.endswith(("attn_q.weight", "attn_k.weight")):
                t = _interleave(t, heads if "attn_q" in gname else kv_heads)
            elif hf.endswith("norm.weight") and (
                    arch == "gemma3" or (arch == "qwen3next" and ".linear_attn." not in hf)):
                t = t + 1
            elif arch == "gptneox" and "attn_qkv" in gname:  # [head][q|k|v] -> [q|k|v][head]
                t = t.reshape(heads, 3, -1, *t.shape[1:]).swapaxes(0, 1).reshape(t.shape)
            elif arch == "gpt2" and t.ndim == 2 and gname.startswith("blk."):
                t = t.T  # Conv1D [in, out] -> [out, in]
            elif gname.endswith("ffn_gate_inp_shexp.weight"):
                t = t.reshape(-1)
            out[gname] = np.ascontiguousarray(t)
    if arch == "gpt2":  # GPT-2's head is its embedding; the converter writes it out as well
        out["output.weight"] = out["token_embd.weight"]
    rope = getattr(c, "rope_parameters", None) or {}
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    if rope.get("rope_type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(rope, head_dim)
    elif rope.get("rope_type") == "longrope":
        out["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        out["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    return out


def _deepseek2_metadata(w: gguf.GGUFWriter, c) -> None:
    """The latent attention as llama.cpp's converter describes it: one KV head of
    kv_lora_rank + rope features, the heads' sizes as the *_mla lengths."""
    w.add_head_count_kv(1)
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    if c.q_lora_rank:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
    w.add_value_length(c.kv_lora_rank)
    w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
    w.add_value_length_mla(c.v_head_dim)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    if c.norm_topk_prob:
        w.add_expert_weights_norm(True)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope.get("mscale_all_dim"):
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _deepseek2_tensor(name: str, t: np.ndarray, c) -> dict[str, np.ndarray]:
    """kv_b_proj split into each head's k_b (transposed) and v_b, the score correction as a
    bias, as llama.cpp's converter writes them."""
    if name.endswith("kv_b_proj.weight"):
        kv_b = t.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
        k_b, v_b = kv_b[:, :c.qk_nope_head_dim], kv_b[:, c.qk_nope_head_dim:]
        return {name.replace("kv_b_proj", "k_b_proj"): k_b.transpose(0, 2, 1),
                name.replace("kv_b_proj", "v_b_proj"): v_b}
    return {name.replace("e_score_correction_bias", "e_score_correction.bias"): t}


def _qwen3next_linear(name: str, t: np.ndarray, c, split_qkvz: bool) -> dict[str, np.ndarray]:
    """A Qwen3-Next linear layer's tensor as llama.cpp's converter writes it: A as -exp(A_log),
    dt_bias as dt_proj's bias, the conv squeezed to [channels, kernel], and in_proj_qkvz's
    rows (grouped per key head) split into q | k | v of all heads and z."""
    if name.endswith(".A_log"):
        return {name: -np.exp(t)}
    if name.endswith(".dt_bias"):
        return {name.replace("dt_bias", "dt_proj.bias"): t}
    if name.endswith("conv1d.weight"):
        return {name: t.squeeze(1)}
    if not name.endswith("in_proj_qkvz.weight") or not split_qkvz:
        return {name: t}
    dk, dv = c.linear_key_head_dim, c.linear_value_head_dim
    per = c.linear_num_value_heads // c.linear_num_key_heads
    grouped = t.reshape(c.linear_num_key_heads, -1, t.shape[-1])
    q, k, v, z = np.split(grouped, np.cumsum([dk, dk, per * dv])[:3], axis=1)
    flat = [a.reshape(-1, t.shape[-1]) for a in (q, k, v, z)]
    return {name.replace("qkvz", "qkv"): np.concatenate(flat[:3]),
            name.replace("qkvz", "z"): flat[3]}


def _gpt_oss_experts(name: str, t: np.ndarray) -> dict[str, np.ndarray]:
    """gpt-oss's stacked experts as llama.cpp's converter splits them: gate and up apart (the
    even and odd columns), weights as [E, out, in]."""
    stem, _, kind = name.rpartition(".experts.")
    base = f"{stem}.experts."
    if kind == "gate_up_proj":
        t = t.transpose(0, 2, 1)
        return {base + "gate_proj.weight": t[:, 0::2], base + "up_proj.weight": t[:, 1::2]}
    if kind == "gate_up_proj_bias":
        return {base + "gate_proj.bias": t[:, 0::2], base + "up_proj.bias": t[:, 1::2]}
    if kind == "down_proj":
        return {base + "down_proj.weight": t.transpose(0, 2, 1)}
    return {base + "down_proj.bias": t}


def write_gguf(path, arch: str, model, qtypes=None, split_qkvz: bool = True) -> None:
    """Write `model` (a transformers model) as a GGUF of architecture `arch`: float32, or the
    GGML type `qtypes(gguf name)` gives a tensor (None: float32; K-quants by the reference
    quantizer of test_gguf_kquants, the others by the gguf package's); `split_qkvz`: see
    _qwen3next_linear."""
    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    _metadata(w, arch, c, getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    for name, t in _tensors(arch, model, split_qkvz).items():
        qtype = qtypes(name) if qtypes is not None else None
        if qtype is None:
            w.add_tensor(name, t)
            continue
        if qtype.name.endswith("_K"):
            from tests.model.test_gguf_kquants import encode

            raw = encode(qtype, t.reshape(-1, 256)).reshape(t.shape[0], -1)
        else:
            raw = gguf.quants.quantize(t, qtype)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
