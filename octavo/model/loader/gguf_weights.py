"""Tensors of a GGUF file, dequantized and renamed to the Hugging Face layout.

llama.cpp's converter renames every tensor (blk.N.attn_q, ...), stacks each MoE layer's experts
into one tensor per projection, and changes some layouts: q/k rows permuted for llama's
interleaved RoPE, Gemma's and Qwen3-Next's norms stored as 1 + w, GPT-2's Conv1D weights
transposed, GPT-NeoX's per-head q/k/v regrouped into q | k | v, Qwen3-Next's A_log stored as
-exp(A_log) and its conv squeezed. This module undoes each, so a model file loads a GGUF
exactly as it loads the Hugging Face checkpoint. RoPE factor tensors (rope_freqs,
rope_factors_long/short) are read into the ArchConfig instead (see arch_config).

Matrices come as lazy tensors (lazy_tensor.py): the layout changes above are reorderings of whole
rows (q/k per head, GPT-NeoX's qkv per head) or a transpose, so they stay lazy, and only the
region a layer keeps is dequantized: a range of rows is a range of the row-major blocks, a range
of columns the blocks covering it in each row. A tensor-parallel rank thus dequantizes its share
only, and another pipeline stage's tensors are never read. Vectors (norms, biases) are read whole.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from octavo.arch_config import ArchConfig
from octavo.disk_cache import write_text
from octavo.model.loader.lazy_tensor import lazy, note_read
from octavo.model.quant.ggml_types import GGMLType
from octavo.model_files import GGUFTensor, open_gguf
from octavo.model_source import cache_dir

_LLAMA = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LLAMA_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
                 "output": "lm_head"}


def _experts(block: str, gate: str, up: str, down: str) -> dict[str, str]:
    """Router and stacked experts of an MoE block; {} stands for the expert index."""
    return {**_LLAMA, "ffn_gate_inp": f"{block}.gate",
            "ffn_gate_exps": f"{block}.experts.{{}}.{gate}",
            "ffn_up_exps": f"{block}.experts.{{}}.{up}",
            "ffn_down_exps": f"{block}.experts.{{}}.{down}"}


_QWEN_MOE = _experts("mlp", "gate_proj", "up_proj", "down_proj")
# Hugging Face architecture -> (layer prefix, GGUF part -> HF part in a layer, global names)
_LAYOUTS: dict[str, tuple[str, dict[str, str], dict[str, str]]] = {
    # Gemma puts a norm before and after each sublayer; GGUF names the one before the MLP ffn_norm.
    "Gemma2ForCausalLM": ("model.layers", {**_LLAMA, "ffn_norm": "pre_feedforward_layernorm"},
                          _LLAMA_GLOBAL),
    "Phi3ForCausalLM": ("model.layers", {**_LLAMA, "attn_qkv": "self_attn.qkv_proj",
                                         "ffn_up": "mlp.gate_up_proj"}, _LLAMA_GLOBAL),
    "MixtralForCausalLM": ("model.layers", _experts("block_sparse_moe", "w1", "w3", "w2"),
                           _LLAMA_GLOBAL),
    "Qwen2MoeForCausalLM": ("model.layers", {
        **_QWEN_MOE, "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
        "ffn_up_shexp": "mlp.shared_expert.up_proj",
        "ffn_down_shexp": "mlp.shared_expert.down_proj",
        "ffn_gate_inp_shexp": "mlp.shared_expert_gate"}, _LLAMA_GLOBAL),
    "Qwen3MoeForCausalLM": ("model.layers", _QWEN_MOE, _LLAMA_GLOBAL),
    "GPTNeoXForCausalLM": ("gpt_neox.layers", {
        "attn_norm": "input_layernorm", "attn_qkv": "attention.query_key_value",
        "attn_output": "attention.dense", "ffn_norm": "post_attention_layernorm",
        "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"},
        {"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm",
         "output": "embed_out"}),
    "Starcoder2ForCausalLM": ("model.layers", {**_LLAMA, "ffn_up": "mlp.c_fc",
                                               "ffn_down": "mlp.c_proj"}, _LLAMA_GLOBAL),
    # GLM-4's norms after each sublayer; its gate_up stays packed
    "Glm4ForCausalLM": ("model.layers", {
        **_LLAMA, "ffn_up": "mlp.gate_up_proj", "post_attention_norm": "post_self_attn_layernorm",
        "post_ffw_norm": "post_mlp_layernorm"}, _LLAMA_GLOBAL),
    "GPT2LMHeadModel": ("transformer.h", {
        "attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
        "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
        {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
         "output_norm": "transformer.ln_f", "output": "lm_head"}),
}
_LAYOUTS["Gemma3ForCausalLM"] = _LAYOUTS["Gemma2ForCausalLM"]
# Llama 4: its MLP is `feed_forward`, MoE (router, experts, shared expert) or dense
_LAYOUTS["Llama4ForCausalLM"] = ("model.layers", {
    **_experts("feed_forward", "gate_proj", "up_proj", "down_proj"),
    "ffn_gate": "feed_forward.gate_proj", "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj", "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj"}, _LLAMA_GLOBAL)
# DeepSeek V2/V3: the latent attention's projections, kv_b split into each head's k_b (stored
# [heads, rank, nope]) and v_b by newer converters, the router's score correction
_LAYOUTS["DeepseekV2ForCausalLM"] = ("model.layers", {
    **_experts("mlp", "gate_proj", "up_proj", "down_proj"),
    **{f"attn_{g}": f"self_attn.{h}" for g, h in (
        ("q_a", "q_a_proj"), ("q_a_norm", "q_a_layernorm"), ("q_b", "q_b_proj"),
        ("kv_a_mqa", "kv_a_proj_with_mqa"), ("kv_a_norm", "kv_a_layernorm"),
        ("kv_b", "kv_b_proj"), ("k_b", "k_b_proj"), ("v_b", "v_b_proj"))},
    "exp_probs_b": "mlp.gate.e_score_correction",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj"}, _LLAMA_GLOBAL)
_LAYOUTS["DeepseekV3ForCausalLM"] = _LAYOUTS["DeepseekV2ForCausalLM"]
# gpt-oss: the router and experts with biases, a sink logit per head
_LAYOUTS["GptOssForCausalLM"] = ("model.layers", {
    **_experts("mlp", "gate_proj", "up_proj", "down_proj"), "ffn_gate_inp": "mlp.router",
    "attn_sinks": "self_attn.sinks"}, _LLAMA_GLOBAL)
# Qwen3-Next: Qwen2-MoE's experts; the linear layers' projections, conv, gated norm, and their
# per-head A (stored as -exp(A_log)) and dt bias, which are parameters of their own
_LAYOUTS["Qwen3NextForCausalLM"] = ("model.layers", {
    **_LAYOUTS["Qwen2MoeForCausalLM"][1],
    **{g: f"linear_attn.{h}" for g, h in (
        ("attn_qkv", "in_proj_qkv"), ("attn_gate", "in_proj_z"), ("ssm_in", "in_proj_qkvz"),
        ("ssm_ba", "in_proj_ba"), ("ssm_conv1d", "conv1d"), ("ssm_norm", "norm"),
        ("ssm_out", "out_proj"), ("ssm_a", "A_log"), ("ssm_dt", "dt_bias"))}}, _LLAMA_GLOBAL)
# GGUF parts that name a parameter, not a module: its .bias (or no suffix) is the parameter
_PARAMETERS = {"ssm_a", "ssm_dt"}
# Llama, Mistral, Qwen2, Qwen3, Granite, OLMo 2 (post-norms only), Cohere
_DEFAULT_LAYOUT = ("model.layers", _LLAMA, _LLAMA_GLOBAL)
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+?)(?:\.(weight|bias))?$")
# Read into ArchConfig.rope_scaling, not parameters.
_ROPE_TENSORS = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}

# Architectures whose converter permuted q/k rows for llama.cpp's interleaved RoPE.
_PERMUTED_QK = {"llama", "mistral", "granite"}
# Architectures whose RMSNorm scales by (1 + w): llama.cpp's converter stores 1 + w. Qwen3-Next's
# gated norm in its linear layers scales by w, and is stored as it is.
_NORM_PLUS_ONE = {"gemma2", "gemma3", "qwen3next"}
_PLAIN_NORMS = ("linear_attn.norm.weight",)
_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")  # GPT-2's [in, out] weights


def hf_name(gguf_name: str, architecture: str) -> str:
    """The Hugging Face name of a GGUF tensor; stacked experts keep {} for the expert index."""
    prefix, layer_names, global_names = _LAYOUTS.get(architecture, _DEFAULT_LAYOUT)
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part not in layer_names or (kind is None and part not in _PARAMETERS):
            raise ValueError(f"GGUF tensor {gguf_name} has no known Hugging Face name "
                             f"({architecture})")
        if part in _PARAMETERS:
            return f"{prefix}.{layer}.{layer_names[part]}"
        return f"{prefix}.{layer}.{layer_names[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in global_names:
        raise ValueError(f"GGUF tensor {gguf_name} has no known Hugging Face name ({architecture})")
    return f"{global_names[stem]}.{kind}"


def _unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo the converter's row permutation (interleaved pairs -> rotate-half halves)."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _to_hf_layout(name: str, w: torch.Tensor, cfg: ArchConfig) -> torch.Tensor:
    """`w` (named `name`, Hugging Face style) in the layout of the Hugging Face checkpoint."""
    arch = cfg.gguf_arch
    if arch in _NORM_PLUS_ONE and name.endswith("norm.weight") and \
            not name.endswith(_PLAIN_NORMS):
        return w - 1
    if arch == "qwen3next" and name.endswith(".A_log"):
        return torch.log(-w)  # stored as A = -exp(A_log)
    if arch == "qwen3next" and name.endswith(".conv1d.weight"):
        return w.reshape(w.shape[0], 1, w.shape[1])  # stored squeezed: [channels, kernel]
    if arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
        return _unpermute(w, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
    if arch == "gptneox" and ".query_key_value." in name:
        # [q|k|v][head][head_dim] rows back to the checkpoint's [head][q|k|v][head_dim]
        return w.reshape(3, cfg.num_heads, -1, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    if arch == "gpt2" and _CONV1D.search(name):
        return w.T
    if name.endswith("shared_expert_gate.weight") and w.ndim == 1:
        return w.reshape(1, -1)  # stored as a vector: [H] -> [1, H]
    return w


def source_bits(tensor_type: GGMLType) -> int:
    """Bits per weight of a GGML type, before its block scales (Q4_1 -> 4, Q8_0 -> 8, F16 -> 16)."""
    m = re.search(r"(?:Q|FP)(\d)", tensor_type.name)  # MXFP4: 4
    if m:
        return int(m.group(1))
    return 32 if tensor_type.name == "F32" else 16


def gguf_tensor_types(path: Path, cfg: ArchConfig) -> dict[str, GGMLType]:
    """Hugging Face name (stacked experts with {}) -> GGML type of each weight in the file.
    Cached on disk per file (path, size, mtime): GGUFReader parses the whole vocabulary first,
    about 2 s of a start that otherwise reads prepared weights in 0.1 s."""
    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}\0"
                         f"{cfg.architecture}".encode()).hexdigest()[:16]
    cached = cache_dir() / "gguf-types" / f"{path.stem}-{key}.json"
    try:
        return {k: GGMLType(v) for k, v in json.loads(cached.read_text()).items()}
    except (OSError, ValueError):
        pass
    types = {hf_name(t.name, cfg.architecture): t.tensor_type for t in open_gguf(path).tensors
             if t.name not in _ROPE_TENSORS and t.name.endswith(".weight")}
    write_text(cached, json.dumps({k: int(v) for k, v in types.items()}),
               "the GGUF's tensor types")  # without it, parsed again next time
    return types


def _code_layout(name: str, a: torch.Tensor, cfg: ArchConfig) -> torch.Tensor:
    """_to_hf_layout's row reorderings, for per-row codes or scales [.., rows, columns] (the
    codes of GPT-2's Conv1D weights are [out, in] already, the layout octavo computes with)."""
    if cfg.gguf_arch in _PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
        return _unpermute(a, cfg.num_heads if "q_proj" in name else cfg.num_kv_heads)
    if cfg.gguf_arch == "gptneox" and ".query_key_value." in name:
        return a.reshape(3, cfg.num_heads, -1, *a.shape[1:]).swapaxes(0, 1).reshape(a.shape)
    return a


class _DequantizedReader:
    """A GGUF tensor [leading dimensions flattened into rows, row length], dequantized by
    rectangles (float types copied)."""

    def __init__(self, name: str, t: GGUFTensor, rows: int, cols: int) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        self.name, self.rows, self.cols = name, rows, cols
        self._raw, self._type = t.data.reshape(rows, -1), t.tensor_type
        self._plain = t.tensor_type in (GGMLType.F32, GGMLType.F16)
        self.dtype = {GGMLType.F32: torch.float32, GGMLType.F16: torch.float16}.get(
            t.tensor_type, torch.float32)  # dequantized: float32
        self._block, self._block_bytes = GGML_QUANT_SIZES[t.tensor_type]

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        if self._plain:
            note_read(self.name, (r1 - r0) * (c1 - c0))
            return torch.from_numpy(np.array(self._raw[r0:r1, c0:c1]))  # a copy: read-only mmap
        from gguf.quants import dequantize

        b0, b1 = c0 // self._block, -(-c1 // self._block)  # the blocks covering the columns
        note_read(self.name, (r1 - r0) * (b1 - b0) * self._block)
        raw = self._raw[r0:r1]
        if (b0, b1) != (0, self._raw.shape[1] // self._block_bytes):
            raw = np.ascontiguousarray(raw[:, b0 * self._block_bytes:b1 * self._block_bytes])
        w = dequantize(raw, self._type).reshape(r1 - r0, -1)
        first = c0 - b0 * self._block
        if first or w.shape[1] != c1 - c0:
            w = np.ascontiguousarray(w[:, first:first + c1 - c0])
        return torch.from_numpy(w)


class _CodeBlocks:
    """A quantized tensor's raw blocks [rows, row bytes], turned into its codes and scales
    (quant/ggml_codes.py's affine_codes for Q4_0/Q4_1/Q4_K/Q5_0, int8_codes for Q8_0/Q5_0/Q6_K)
    by rectangles of whole blocks. One conversion gives every kind: the ones not asked for yet are
    kept for their readers."""

    def __init__(self, t: GGUFTensor, rows: int, form: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES

        from octavo.model.quant.ggml_codes import affine_codes, int8_codes, mx_codes
        from octavo.model.quant.gguf import CODE_FORMS

        self.kinds = CODE_FORMS[form]
        self._convert = {"int8": int8_codes, "mx": mx_codes}.get(form, affine_codes)
        self._raw, self._type = t.data.reshape(rows, -1), t.tensor_type
        self._block_bytes = GGML_QUANT_SIZES[t.tensor_type][1]
        self.blocks = self._raw.shape[1] // self._block_bytes
        first = self._convert(self._type,
                              np.ascontiguousarray(self._raw[:1, :self._block_bytes]))
        self.columns_per_block = {k: a.shape[1] for k, a in zip(self.kinds, first)}
        self._kept: dict[tuple[int, int, int, int], dict[str, np.ndarray]] = {}

    def kind(self, kind: str, r0: int, r1: int, b0: int, b1: int) -> np.ndarray:
        key = (r0, r1, b0, b1)
        kept = self._kept.get(key)
        if kept is None or kind not in kept:
            raw = self._raw[r0:r1]
            if (b0, b1) != (0, self.blocks):
                raw = np.ascontiguousarray(raw[:, b0 * self._block_bytes:b1 * self._block_bytes])
            kept = self._kept[key] = dict(zip(self.kinds, self._convert(self._type, raw)))
        out = kept.pop(kind)
        if not kept:
            del self._kept[key]
        return out


class _CodesReader:
    """One kind (codes, scales or offsets) of a `_CodeBlocks`, [rows, the kind's columns]."""

    def __init__(self, name: str, blocks: _CodeBlocks, kind: str, rows: int) -> None:
        self.name, self._blocks, self._kind, self.rows = name, blocks, kind, rows
        self._per_block = blocks.columns_per_block[kind]
        self.cols = blocks.blocks * self._per_block
        self.dtype = {"gguf_q4": torch.uint8, "gguf_q8": torch.int8, "gguf_mx": torch.uint8,
                      "gguf_mx_scale": torch.uint8}.get(kind, torch.float32)

    def read(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor:
        b0, b1 = c0 // self._per_block, -(-c1 // self._per_block)
        note_read(self.name, (r1 - r0) * (b1 - b0) * self._per_block)
        a = self._blocks.kind(self._kind, r0, r1, b0, b1)
        first = c0 - b0 * self._per_block
        if first or a.shape[1] != c1 - c0:
            a = np.ascontiguousarray(a[:, first:first + c1 - c0])
        return torch.from_numpy(a)


def _dense(name: str, t: GGUFTensor, shape: tuple[int, ...]) -> torch.Tensor:
    """The tensor dequantized: lazy for a matrix, read now for a vector."""
    if len(shape) >= 2:
        return lazy(_DequantizedReader(name, t, int(np.prod(shape[:-1])), shape[-1]), shape)
    if t.tensor_type in (GGMLType.F32, GGMLType.F16):
        return torch.from_numpy(np.array(t.data).reshape(shape))  # a copy: the mmap is read-only
    from gguf.quants import dequantize

    return torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(shape))


def gguf_table(path: Path, cfg: ArchConfig, name: str) -> tuple[GGMLType, torch.Tensor] | None:
    """Checkpoint weight `name` (a Hugging Face name) as its GGML type and raw blocks
    [rows, row bytes] uint8, if its type is Q8_0, Q5_0 or Q6_K (whose codes a packed weight
    keeps exactly: quant/gguf.py); else None. For the vocabulary tables, which no layout
    reorders."""
    from octavo.model.quant.gguf import INT8_EXACT

    for t in open_gguf(path).tensors:
        if hf_name(t.name, cfg.architecture) == name:
            if t.tensor_type not in INT8_EXACT:
                return None
            rows = int(np.prod([int(d) for d in t.shape[1:]]))
            return t.tensor_type, torch.from_numpy(np.array(t.data).reshape(rows, -1))
    return None


def iterate_gguf_weights(path: Path, cfg: ArchConfig, bits: dict[str, int] | None = None,
                         codes: dict[str, str] | None = None, dense_too: bool = True,
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, dequantized tensor, lazy for a matrix); `bits` gets each
    tensor's source width. A stacked expert tensor [E, out, in] is yielded as E per-expert
    tensors. For the names in `codes` (stacked experts with {}), the codes come too in the
    form it names (quant/gguf.py's CODE_FORMS): "int4" (Q4_0/Q4_1/Q4_K/Q5_0: affine codes) as
    `<module>.gguf_q4`, `.gguf_q4_scale`, `.gguf_q4_low`, "int8" (Q8_0/Q5_0/Q6_K) as
    `.gguf_q8`, `.gguf_q8_scale`; without `dense_too` instead of the dequantized weight."""
    codes = codes or {}
    reader = open_gguf(path)  # checked whole first: every tensor's data lies inside the file
    for t in reader.tensors:
        if t.name in _ROPE_TENSORS:
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        name = hf_name(t.name, cfg.architecture)
        out: dict[str, torch.Tensor] = {}
        if name in codes:
            rows = int(np.prod(shape[:-1]))
            blocks = _CodeBlocks(t, rows, codes[name])
            for kind in blocks.kinds:
                key = name.removesuffix("weight") + kind
                part = _CodesReader(key, blocks, kind, rows)
                out[key] = _code_layout(name, lazy(part, (*shape[:-1], part.cols)), cfg)
        if name not in codes or dense_too:
            out[name] = _to_hf_layout(name, _dense(name, t, shape), cfg)
        for key, w in out.items():
            parts = [(key.format(e), w[e]) for e in range(w.shape[0])] if "{}" in key \
                else [(key, w)]
            for part_name, part in parts:
                if bits is not None and key == name:
                    bits[part_name] = source_bits(t.tensor_type)
                yield part_name, part
