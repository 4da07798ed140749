"""A model's architecture, normalized from a Hugging Face config.json or GGUF metadata.

Torch-free: the front end reads it for the context length, the worker for building the model.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from octavo.disk_cache import write_text
from octavo.model_files import open_gguf
from octavo.model_source import ModelSource, cache_dir
from octavo.params import SamplingParams

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

# Bidirectional encoders: they pool (embeddings), never generate.
ENCODER_ARCHITECTURES = ("BertModel", "BertForSequenceClassification", "RobertaModel",
                         "XLMRobertaModel", "RobertaForSequenceClassification",
                         "XLMRobertaForSequenceClassification", "ModernBertModel",
                         "ModernBertForSequenceClassification")
SLIDING, FULL = "sliding_attention", "full_attention"
# A layer whose queries see only the keys of their own attention_chunk_size-token chunk (Llama 4)
CHUNKED = "chunked_attention"
# A layer of linear attention over a recurrent state per request, no KV cache (Qwen3-Next)
LINEAR = "linear_attention"
# generation_config.json keys that become request defaults (the SamplingParams field names)
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6  # of RMSNorm, or of LayerNorm in the families that use it
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    eos_token_ids: tuple[int, ...] = ()  # from generation_config.json, when it names several
    # generation_config.json's sampling settings, the defaults of requests that leave them unset
    sampling_defaults: dict[str, Any] = field(default_factory=dict)
    sliding_window: int | None = None  # sliding layers attend to at most this many latest tokens
    # Per layer SLIDING, FULL, CHUNKED or LINEAR; empty means every layer is sliding when
    # sliding_window is set.
    layer_types: tuple[str, ...] = ()
    rotary_dim: int | None = None  # RoPE covers only this many leading features of a head
    rope_local_theta: float | None = None  # RoPE base of sliding layers, when it differs (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (Gemma)
    attn_logit_softcap: float | None = None  # tanh soft-capping of attention scores (Gemma 2)
    final_logit_softcap: float | None = None  # ... and of the output logits
    # Family-specific keys (MoE sizes, partial rotary, ...), read by that family's model file.
    extra: dict[str, Any] = field(default_factory=dict)
    gguf_arch: str | None = None  # set for GGUF files: their tensor layout differs
    pooling: str | None = None  # sentence-transformers' Pooling module: mean, cls or last
    pooling_normalize: bool | None = None  # whether its Normalize module follows (None: no files)
    matryoshka: bool = False  # config.json's is_matryoshka: an embedding may be cut short
    num_labels: int = 0  # a *ForSequenceClassification head's outputs (0: no such head)
    sep_token_id: int | None = None  # an encoder's separator: a sentence pair's second part
    # starts after the first one (its token type 1)
    attention_chunk_size: int | None = None  # the chunk of CHUNKED layers (Llama 4)

    @property
    def is_encoder(self) -> bool:
        return self.architecture in ENCODER_ARCHITECTURES

    @property
    def generates(self) -> bool:
        """Whether it has an LM head: not an encoder, nor a classifier."""
        return not self.is_encoder and not self.num_labels

    @property
    def pooling_kind(self) -> str:
        """How an embedding pools the hidden states: sentence-transformers' mode where the
        folder says, else [CLS] for an encoder and the last token for a decoder (as vLLM)."""
        return self.pooling or ("cls" if self.is_encoder else "last")

    @property
    def pooling_normalizes(self) -> bool:
        """Whether embeddings are normalized by default (without sentence-transformers' files:
        yes, as vLLM)."""
        return True if self.pooling_normalize is None else self.pooling_normalize

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, or None when it attends to the whole context."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != SLIDING):
            return None
        return self.sliding_window

    def layer_chunk(self, layer: int) -> int | None:
        """The attention chunk of `layer` (its queries see the keys of their own chunk only),
        or None."""
        if not self.layer_types or self.layer_types[layer] != CHUNKED:
            return None
        return self.attention_chunk_size

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The layers of linear attention, which keep a recurrent state per request instead of
        KV-cache blocks."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    def required(self, key: str, *aliases: str) -> Any:
        """A family's own config.json key (or the first of its aliases that is set); a
        ValueError naming it where none is."""
        for k in (key, *aliases):
            if self.extra.get(k) is not None:
                return self.extra[k]
        raise ValueError(f"config.json lacks {key!r}, which {self.architecture} needs")

    @property
    def num_experts(self) -> int:
        """The routed experts of a mixture-of-experts model's sparse layers (0: dense)."""
        return int(self.extra.get("num_experts") or self.extra.get("num_local_experts") or 0)

    def moe_layer(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts: Qwen's mlp_only_layers and
        decoder_sparse_step keep some layers dense."""
        step = self.extra.get("decoder_sparse_step") or 1
        return bool(self.num_experts) and layer not in (self.extra.get("mlp_only_layers") or []) \
            and (layer + 1) % step == 0

    @property
    def all_layers_sliding(self) -> bool:
        """True when no layer ever reads keys older than the window (blocks may be freed)."""
        return all(self.layer_window(i) is not None for i in range(self.num_layers))


def read_arch_config(source: ModelSource) -> ArchConfig:
    if not source.is_gguf:
        return _from_hf(source)
    # Parsing a GGUF's header takes seconds (it lists every tensor and the whole vocabulary), so
    # the result is kept beside the tokenizer cache, keyed by the file and this module's code.
    stat = source.path.stat()
    key = hashlib.sha256(f"{source.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
                         + Path(__file__).read_bytes()).hexdigest()[:16]
    cached = cache_dir() / "configs" / f"{source.path.stem}-{key}.json"
    try:
        return _config_from_json(json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    cfg = _from_gguf(source)
    write_text(cached, json.dumps(asdict(cfg)), "the GGUF's parsed config")  # else parsed again
    return cfg


def _config_from_json(data: dict[str, Any]) -> ArchConfig:
    tuples = {f.name for f in fields(ArchConfig) if str(f.type).startswith("tuple")}
    return ArchConfig(**{k: tuple(v) if k in tuples else v for k, v in data.items()})


def _from_hf(source: ModelSource) -> ArchConfig:
    cfg = json.loads((source.path / "config.json").read_text())
    archs = cfg.get("architectures") or []
    if not archs:
        raise ValueError(f"model: {source.path}/config.json names no architectures")
    text = dict(cfg.get("text_config", cfg))
    for key, alias in _ALIASES:  # GPT-2 style names
        if text.get(key) is None and text.get(alias) is not None:
            text[key] = text[alias]

    def need(key: str) -> Any:
        if text.get(key) is None:
            raise ValueError(f"model: {source.path}/config.json lacks {key!r} ({archs[0]})")
        return text[key]

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    eos: tuple[int, ...] = ()
    sampling: dict[str, Any] = {}
    gen_path = source.path / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        gen_eos = gen.get("eos_token_id")
        if gen_eos is not None:
            eos = tuple(gen_eos) if isinstance(gen_eos, list) else (gen_eos,)
        sampling = {k: gen[k] for k in SAMPLING_KEYS if gen.get(k) is not None}
        try:
            SamplingParams(**sampling)
        except ValueError as exc:
            raise ValueError(f"model: {gen_path}: {exc}") from None
    rope_theta, rope_scaling, local_theta = _hf_rope(text)
    head_dim = text.get("head_dim") or hidden // heads
    positions = text.get("max_position_embeddings", 2048)
    if "Roberta" in archs[0]:  # its table starts past the padding id: that much less context
        positions -= text.get("pad_token_id", 1) + 1
    # transformers reads the factor from rope_parameters first (its top-level copy may be stale).
    partial = ((text.get("rope_parameters") or {}).get("partial_rotary_factor")
               or text.get("partial_rotary_factor") or text.get("rotary_pct") or 1.0)
    num_layers = need("num_hidden_layers")
    layer_types = _hf_layer_types(archs[0], text, num_layers)
    window = text.get("sliding_window")
    if archs[0].startswith("ModernBert"):  # a bidirectional window: this far either side
        window = text.get("local_attention", 128) // 2
    # Qwen2 configs name a window they do not use unless use_sliding_window is set.
    if not text.get("use_sliding_window", True) or (layer_types and SLIDING not in layer_types):
        window = None
        layer_types = layer_types if set(layer_types) - {SLIDING, FULL} else ()
    if layer_types and all(t == SLIDING for t in layer_types):
        layer_types = ()
    pooling, normalize = _sentence_transformers_pooling(source.path)
    return ArchConfig(
        architecture=archs[0],
        vocab_size=need("vocab_size"),
        hidden_size=hidden,
        intermediate_size=text.get("intermediate_size") or 4 * hidden,
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=(heads if archs[0] in _MHA_ONLY else text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        max_position_embeddings=positions,
        rms_norm_eps=text.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta or 10000.0,
        rope_scaling=rope_scaling,
        tie_word_embeddings=cfg.get("tie_word_embeddings", text.get(
            "tie_word_embeddings", archs[0] in _TIED_BY_DEFAULT)),
        attention_bias=text.get("attention_bias",
                                text.get("qkv_bias", archs[0].startswith("Qwen2"))),
        hidden_act=text.get("hidden_activation") or text.get("hidden_act", "silu"),
        eos_token_ids=eos,
        sampling_defaults=sampling,
        sliding_window=window,
        layer_types=layer_types,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        rope_local_theta=local_theta,
        query_pre_attn_scalar=text.get("query_pre_attn_scalar"),
        attn_logit_softcap=text.get("attn_logit_softcapping"),
        final_logit_softcap=text.get("final_logit_softcapping"),
        extra=text,
        pooling=pooling,
        pooling_normalize=normalize,
        matryoshka=bool(cfg.get("is_matryoshka") or cfg.get("matryoshka_dimensions")),
        num_labels=(len(cfg.get("id2label") or {}) or cfg.get("num_labels") or 2)
        if archs[0].endswith("ForSequenceClassification") else 0,
        sep_token_id=_sep_token_id(source.path) if archs[0] in ENCODER_ARCHITECTURES else None,
        attention_chunk_size=_attention_chunk(text, layer_types),
    )


def _attention_chunk(text: dict[str, Any], layer_types: tuple[str, ...]) -> int | None:
    if CHUNKED not in layer_types:
        return None
    chunk = text.get("attention_chunk_size")
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"config.json: chunked_attention layers need a positive "
                         f"attention_chunk_size, got {chunk!r}")
    return chunk


def _sep_token_id(folder: Path) -> int | None:
    """The id of the tokenizer's sep_token (tokenizer_config.json or special_tokens_map.json,
    looked up in tokenizer.json), else None."""
    sep = None
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the second wins
        path = folder / name
        if path.is_file():
            value = json.loads(path.read_text()).get("sep_token", sep)
            sep = value.get("content") if isinstance(value, dict) else value
    path = folder / "tokenizer.json"
    if sep is None or not path.is_file():
        return None
    tok = json.loads(path.read_text())
    for added in tok.get("added_tokens", []):
        if added.get("content") == sep:
            return added["id"]
    vocab = tok.get("model", {}).get("vocab")
    return vocab.get(sep) if isinstance(vocab, dict) else None


_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                  "pooling_mode_lasttoken": "last"}


def _sentence_transformers_pooling(folder: Path) -> tuple[str | None, bool | None]:
    """sentence-transformers' modules.json: its Pooling module's mode, and whether a Normalize
    module follows; (None, None) where the folder has no such file."""
    path = folder / "modules.json"
    if not path.is_file():
        return None, None
    modules = {m.get("type", "").rpartition(".")[2]: m for m in json.loads(path.read_text())}
    unknown = set(modules) - {"Transformer", "Pooling", "Normalize"}
    if unknown:
        raise NotImplementedError(f"model: {path} has sentence-transformers modules "
                                  f"{sorted(unknown)}; octavo runs Transformer, Pooling and "
                                  f"Normalize only")
    pooling = None
    if "Pooling" in modules:
        pool_path = folder / modules["Pooling"].get("path", "") / "config.json"
        settings = json.loads(pool_path.read_text())
        modes = [mode for key, mode in _POOLING_MODES.items() if settings.get(key)]
        others = [k for k, v in settings.items()
                  if k.startswith("pooling_mode_") and v and k not in _POOLING_MODES]
        if others or len(modes) != 1:
            raise NotImplementedError(f"model: {pool_path} pools with {sorted(others) or modes}; "
                                      f"octavo pools with exactly one of "
                                      f"{', '.join(_POOLING_MODES)}")
        pooling = modes[0]
    return pooling, "Normalize" in modules


# Families whose transformers config ties the LM head to the embedding unless it says not to:
# a config.json saved with its defaults left out omits the key.
_TIED_BY_DEFAULT = {"GPT2LMHeadModel", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
                    "Starcoder2ForCausalLM", "CohereForCausalLM"}
# Families without grouped-query attention: a num_key_value_heads in their config means nothing.
_MHA_ONLY = {"GPTNeoXForCausalLM", "GPT2LMHeadModel"}
_ALIASES = [("hidden_size", "n_embd"), ("num_attention_heads", "n_head"),
            ("num_hidden_layers", "n_layer"), ("max_position_embeddings", "n_positions"),
            ("intermediate_size", "n_inner"), ("hidden_act", "activation_function"),
            ("rms_norm_eps", "layer_norm_eps"), ("rms_norm_eps", "layer_norm_epsilon"),
            ("rms_norm_eps", "norm_eps"), ("rms_norm_eps", "norm_epsilon"),
            ("rope_theta", "rotary_emb_base"),
            # ModernBERT's configs from before transformers 5
            ("rope_theta", "global_rope_theta"), ("rope_local_base_freq", "local_rope_theta")]


def _hf_rope(text: dict[str, Any]) -> tuple[float | None, dict[str, Any] | None, float | None]:
    """(theta, scaling of the full layers, theta of the sliding layers) from either config style."""
    theta, scaling = text.get("rope_theta"), text.get("rope_scaling")
    local = text.get("rope_local_base_freq")
    params = text.get("rope_parameters")  # transformers >= 5 folds theta and scaling here
    if isinstance(params, dict) and FULL in params:  # ... per layer type (Gemma 3)
        local = (params.get(SLIDING) or {}).get("rope_theta", local)
        params = params[FULL]
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if params.get("rope_type", "default") != "default":
            scaling = params
    if scaling and scaling.get("rope_type", scaling.get("type")) == "default":
        scaling = None
    return theta, scaling, local


def _hf_layer_types(arch: str, text: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = text.get("layer_types")
    if types is None and arch.startswith("Gemma2"):  # configs written before layer_types
        types = [SLIDING if i % 2 == 0 else FULL for i in range(num_layers)]
    elif types is None and arch.startswith("Gemma3"):
        pattern = text.get("sliding_window_pattern", 6)
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    elif types is None and arch.startswith("ModernBert"):
        every = text.get("global_attn_every_n_layers", 3)
        types = [SLIDING if i % every else FULL for i in range(num_layers)]
    elif types is None and arch.startswith("Qwen3Next"):  # configs written before layer_types
        every = text.get("full_attention_interval", 4)
        types = [LINEAR if (i + 1) % every else FULL for i in range(num_layers)]
    if types is None:
        return ()
    if len(types) != num_layers or set(types) - {SLIDING, FULL, CHUNKED, LINEAR}:
        raise ValueError(f"config.json: layer_types must list {SLIDING!r}, {FULL!r}, "
                         f"{CHUNKED!r} or {LINEAR!r} for each of the {num_layers} layers, got "
                         f"{types}")
    return tuple(types)


def _from_gguf(source: ModelSource) -> ArchConfig:
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
