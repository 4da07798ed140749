"""A model's architecture, normalized from a Hugging Face config.json or GGUF metadata (the
GGUF half: gguf_arch_config.py).

Torch-free: the front end reads it for the context length, the worker for building the model.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from octavo.disk_cache import write_text
from octavo.model_source import ModelSource, cache_dir
from octavo.params import SamplingParams


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
    # the result is kept beside the tokenizer cache, keyed by the file and the parsing code.
    stat = source.path.stat()
    key = hashlib.sha256(f"{source.path.resolve()}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()
                         + Path(__file__).read_bytes()
                         + Path(__file__).with_name("gguf_arch_config.py").read_bytes()
                         ).hexdigest()[:16]
    cached = cache_dir() / "configs" / f"{source.path.stem}-{key}.json"
    try:
        return _config_from_json(json.loads(cached.read_text()))
    except (OSError, ValueError, TypeError):
        pass
    from octavo.gguf_arch_config import from_gguf  # imports this module
    cfg = from_gguf(source)
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
