"""A PEFT LoRA adapter on disk: its adapter_config.json and the names and shapes in its
adapter_model.safetensors header, read and checked against the base model's shapes without
loading a tensor (and without torch), so that the front end refuses a bad adapter before its
request is queued. The worker loads the tensors of an adapter that passed (worker/lora.py).

A LoRA target adds `scaling * B (A x)` to a layer's output: A is [rank, in], B [out, rank],
scaling `lora_alpha / rank` (`lora_alpha / sqrt(rank)` with rslora). The embedding's pair
(PEFT's lora_embedding_A/B) is alike with the vocabulary as its input: A [rank, vocab] is
looked up by token id.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from octavo.arch_config import ArchConfig
from octavo.params import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_MAX_HEADER = 64 << 20  # a safetensors header larger than this is a corrupt file
# base_model.model.<module>.lora_A.weight (PEFT's default adapter drops its name from the key)
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.(?P<kind>lora_A|lora_B|lora_embedding_A|"
                  r"lora_embedding_B)(?:\.weight)?$")
# PEFT saves the vocabulary layers an adapter targets whole beside their pair; untouched by
# LoRA training, they equal the base model's unless the vocabulary was resized.
_BASE_COPY = re.compile(r"^base_model\.model\.(?P<module>.+)\.base_layer\.weight$")
_LAYER = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?P<rest>.+)$")
# A mixture's experts, one pair per expert and projection (Mixtral's w1/w3/w2 or gate/up/down:
# PEFT on transformers 4, and vLLM's layout), or one pair over every expert of a stacked
# tensor (PEFT's target_parameters on transformers 5's fused experts: gate_up_proj, down_proj).
_EXPERT = re.compile(r"^(?:mlp|block_sparse_moe)\.experts\.(?:(?P<expert>\d+)\.(?P<proj>gate_proj|"
                     r"up_proj|down_proj|w1|w3|w2)|(?P<stacked>gate_up_proj|down_proj))$")
# PEFT nests the pairs of a module's targeted parameters as base_layer, in the order the module
# declares them; their shapes tell which is which.
_STACKED = re.compile(r"^(?P<experts>model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)"
                      r"(?:\.base_layer)*$")
_PROJECTION = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up",
               "down_proj": "down", "w2": "down", "gate_up_proj": "gate_up"}


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names it."""


@dataclass(frozen=True)
class LoRATarget:
    """One module the adapter changes: its name in the base checkpoint (model.layers.3.mlp.
    up_proj, lm_head, model.embed_tokens), its A and B tensors' names, and its rank and
    scaling."""

    module: str
    a_name: str
    b_name: str
    rank: int
    scaling: float
    embedding: bool  # A is looked up by token id rather than multiplied
    # A stacked pair over this many experts (A [rank * experts, in], B [out, rank * experts]:
    # column r * experts + e of B is expert e's); 0 for a pair of one module.
    experts: int = 0


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter that passed every check: where its weights are and what they change."""

    request: LoRARequest
    weights_path: Path
    rank: int
    targets: tuple[LoRATarget, ...]


def read_adapter(request: LoRARequest, arch: ArchConfig, max_rank: int) -> AdapterSpec:
    """Read `request`'s adapter and check it against the base model `arch` and the engine's
    `max_rank`: every problem is an AdapterError naming the adapter."""
    name = f"LoRA adapter {request.lora_name!r} ({request.lora_path})"
    try:
        return _read(Path(request.lora_path), request, arch, max_rank)
    except AdapterError as exc:
        raise AdapterError(f"{name}: {exc}") from None
    except (OSError, ValueError, UnicodeDecodeError, struct.error) as exc:
        raise AdapterError(f"{name}: {type(exc).__name__}: {exc}") from None


def _read(root: Path, request: LoRARequest, arch: ArchConfig, max_rank: int) -> AdapterSpec:
    if not root.is_dir():
        raise AdapterError("no such directory")
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise AdapterError(f"{CONFIG_FILE} is missing")
    config = json.loads(config_path.read_text())
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} is not a JSON object")
    _check_config(config)
    weights = root / WEIGHTS_FILE
    if not weights.is_file():
        found = "adapter_model.bin (a pickle, which octavo never loads)" if (
            root / "adapter_model.bin").exists() else "nothing"
        raise AdapterError(f"{WEIGHTS_FILE} is missing (found {found})")
    header = read_safetensors_header(weights)
    pairs: dict[str, dict[str, tuple[str, list[int]]]] = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        copy = _BASE_COPY.match(key)
        if copy is not None:
            _check_base_copy(copy["module"], list(info["shape"]), arch)
            continue
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"tensor {key!r} is not a LoRA A or B matrix (octavo serves "
                               f"plain LoRA: no modules_to_save, biases or DoRA magnitudes)")
        kind = m["kind"].replace("embedding_", "")
        pairs.setdefault(m["module"], {})[kind] = (key, list(info["shape"]))
    if not pairs:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    rslora = bool(config.get("use_rslora", False))
    targets = []
    for module, found in sorted(pairs.items()):
        if set(found) != {"lora_A", "lora_B"}:
            raise AdapterError(f"{module} has {sorted(found)} but needs lora_A and lora_B")
        (a_name, a_shape), (b_name, b_shape) = found["lora_A"], found["lora_B"]
        if len(a_shape) != 2 or len(b_shape) != 2 or b_shape[1] != a_shape[0]:
            raise AdapterError(f"{module}: A {a_shape} and B {b_shape} do not share a rank")
        got = (b_shape[0], a_shape[1])  # (out, in)
        experts = 0
        if _STACKED.match(module):
            module, experts = _stacked_module(module, got, arch), arch.num_experts
            if a_shape[0] % experts:
                raise AdapterError(f"{module}: A has {a_shape[0]} rows, not a rank for each "
                                   f"of {experts} experts")
        rank = a_shape[0] // max(experts, 1)
        if rank > max_rank:
            raise AdapterError(f"{module} has rank {rank}, above --max-lora-rank {max_rank}")
        embedding = "lora_embedding_A" in a_name
        want = module_shape(module, arch)
        if got != want:
            raise AdapterError(f"{module}: the adapter is for a layer of (out, in) {got}, the "
                               f"base model's is {want}")
        if any(t.module == module for t in targets):
            raise AdapterError(f"{module} has two LoRA pairs")
        scaling = _alpha(config, module) / (math.sqrt(rank) if rslora else rank)
        targets.append(LoRATarget(module, a_name, b_name, rank, scaling, embedding, experts))
    return AdapterSpec(request, weights, max(t.rank for t in targets), tuple(targets))


def _stacked_module(module: str, shape: tuple[int, int], arch: ArchConfig) -> str:
    """The stacked expert tensor a pair on `<layer>.experts` changes, told by its (out, in)."""
    experts = _STACKED.match(module)["experts"]
    for proj in ("gate_up_proj", "down_proj"):
        name = f"{experts}.{proj}"
        try:
            if module_shape(name, arch) == shape:
                return name
        except AdapterError:
            break  # not a mixture-of-experts layer: module_shape says so below
    return f"{experts}.{shape}"  # refused by module_shape with the base model's shapes


def expert_projection(rest: str) -> tuple[int | None, str] | None:
    """(expert, projection: gate, up, down or gate_up) of a layer's module name below
    model.layers.<n> (expert None: a pair stacked over every expert); None for other modules."""
    m = _EXPERT.match(rest)
    if m is None:
        return None
    if m["stacked"]:
        return None, _PROJECTION[m["stacked"]]
    return int(m["expert"]), _PROJECTION[m["proj"]]


def _check_base_copy(module: str, shape: list[int], arch: ArchConfig) -> None:
    if module not in ("lm_head", "model.embed_tokens"):
        raise AdapterError(f"tensor {module}.base_layer.weight replaces a base weight")
    if shape != [arch.vocab_size, arch.hidden_size]:
        raise AdapterError(f"{module} has {shape[0]} vocabulary rows, the base model "
                           f"{arch.vocab_size}: adapters that add tokens are not supported")


def _check_config(config: dict[str, Any]) -> None:
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type is {peft_type!r}; octavo serves LORA adapters")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"bias={config['bias']!r}: adapters that train biases are not "
                           f"supported")
    if config.get("modules_to_save"):
        raise AdapterError(f"modules_to_save {config['modules_to_save']} would replace whole "
                           f"base modules, which octavo does not serve")
    _check_alpha("lora_alpha", config.get("lora_alpha", 8))
    patterns = config.get("alpha_pattern") or {}
    if not isinstance(patterns, dict):
        raise AdapterError("alpha_pattern must map module patterns to alphas")
    for pattern, alpha in patterns.items():
        _check_alpha(f"alpha_pattern[{pattern!r}]", alpha)
        try:
            re.compile(pattern)
        except re.error as exc:
            raise AdapterError(f"alpha_pattern key {pattern!r} is not a regular expression: "
                               f"{exc}") from None


def _check_alpha(field: str, alpha: Any) -> None:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not alpha > 0:
        raise AdapterError(f"{field} must be a positive number, got {alpha!r}")


def _alpha(config: dict[str, Any], module: str) -> float:
    """The module's lora_alpha: alpha_pattern's first key that matches the end of its name
    (PEFT's rule), else lora_alpha. Ranks come from the tensors' shapes (rank_pattern's)."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config.get("lora_alpha", 8))


# Phi-3's checkpoints hold q/k/v and gate/up fused: an adapter's pair spans the fused layer.
_FUSED_PAIRS = ("Phi3ForCausalLM",)


# The architectures whose native files take adapters. The others are refused: GPT-2 and
# GPT-NeoX name their projections otherwise (Conv1D c_attn/c_fc, a per-head interleaved
# query_key_value), encoders and classifiers have none adapted, and a model the transformers
# backend runs has transformers' modules, not octavo's.
_ADAPTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
            "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM",
            "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def check_architecture(arch: ArchConfig, model_impl: str = "auto") -> None:
    """ValueError where octavo serves no adapters on the base model: an architecture whose
    adapter layout it does not map, or a model run by the transformers backend."""
    if arch.architecture not in _ADAPTED or model_impl == "transformers":
        how = " through the transformers backend" if arch.architecture in _ADAPTED else ""
        raise ValueError(f"LoRA adapters are not supported on {arch.architecture}{how} "
                         f"(octavo maps the adapter layouts of Llama, Mistral, Qwen2/3, "
                         f"Gemma 2/3, Phi-3, Mixtral and Qwen2/3-MoE in its own files); start "
                         f"without enable_lora")


def module_shape(module: str, arch: ArchConfig) -> tuple[int, int]:
    """A base module's (out, in) features as a LoRA pair sees them; AdapterError for a module
    octavo does not adapt or the model lacks."""
    hidden, heads, kv = arch.hidden_size, arch.num_heads, arch.num_kv_heads
    if module == "lm_head":
        return arch.vocab_size, hidden
    if module == "model.embed_tokens":
        return hidden, arch.vocab_size
    m = _LAYER.match(module)
    if m is None or int(m["layer"]) >= arch.num_layers:
        raise AdapterError(f"the base model has no module {module}")
    shapes = {
        "self_attn.q_proj": (heads * arch.head_dim, hidden),
        "self_attn.k_proj": (kv * arch.head_dim, hidden),
        "self_attn.v_proj": (kv * arch.head_dim, hidden),
        "self_attn.o_proj": (hidden, heads * arch.head_dim),
    }
    if arch.architecture in _FUSED_PAIRS:
        shapes["self_attn.qkv_proj"] = ((heads + 2 * kv) * arch.head_dim, hidden)
        shapes["mlp.gate_up_proj"] = (2 * arch.intermediate_size, hidden)
    rest = m["rest"]
    if not arch.moe_layer(int(m["layer"])):
        shapes.update(_mlp_shapes("mlp", arch.intermediate_size, hidden))
    else:
        if arch.extra.get("shared_expert_intermediate_size"):
            shapes.update(_mlp_shapes("mlp.shared_expert",
                                      arch.extra["shared_expert_intermediate_size"], hidden))
        expert = expert_projection(rest)
        if expert is not None and (expert[0] or 0) < arch.num_experts:
            width = arch.extra.get("moe_intermediate_size") or arch.intermediate_size
            return {"gate": (width, hidden), "up": (width, hidden), "down": (hidden, width),
                    "gate_up": (2 * width, hidden)}[expert[1]]
    if rest not in shapes:
        raise AdapterError(f"the base model has no module {module} that octavo adapts "
                           f"(q/k/v/o_proj, gate/up/down_proj, a mixture's experts and shared "
                           f"expert, embed_tokens, lm_head)")
    return shapes[rest]


def _mlp_shapes(prefix: str, width: int, hidden: int) -> dict[str, tuple[int, int]]:
    return {f"{prefix}.gate_proj": (width, hidden), f"{prefix}.up_proj": (width, hidden),
            f"{prefix}.down_proj": (hidden, width)}


def read_safetensors_header(path: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file: tensor name -> dtype, shape, offsets."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise AdapterError(f"{path.name} is truncated")
        (length,) = struct.unpack("<Q", raw)
        if length > min(size - 8, _MAX_HEADER):
            raise AdapterError(f"{path.name} is corrupt (header of {length} bytes)")
        header = json.loads(f.read(length))
    if not isinstance(header, dict):
        raise AdapterError(f"{path.name} is corrupt (header is not a JSON object)")
    for key, info in header.items():
        if key == "__metadata__":
            continue
        begin, end = info.get("data_offsets", (0, -1)) if isinstance(info, dict) else (0, -1)
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or \
                not 0 <= begin <= end <= size - 8 - length:
            raise AdapterError(f"{path.name} is corrupt (tensor {key!r})")
    return header
