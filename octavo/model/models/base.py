"""What every model file shares: streaming checkpoint tensors into parameters (packed q/k/v and
gate/up slots, shape checks: `CheckpointModel`); and what every causal LM adds: forward over
`self.model`, logits from `self.lm_head` (`CausalLM`)."""
from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.distributed import parallel_state
from octavo.model.kv_spec import NO_KV, KVCacheSpec
from octavo.model.layers.embedding import Embedding, LMHead
from octavo.model.layers.linear import local_heads
from octavo.model.layers.moe import EXPERT_TENSOR
from octavo.model.pipeline import local_layer_name, run_stage


# Checkpoint q/k/v and gate/up projections, packed into one matrix each (slot = checkpoint order).
QKV_GATE_UP: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class CheckpointModel(nn.Module):
    # checkpoint name fragment -> (packed parameter fragment, slot, or the consecutive slots one
    # checkpoint tensor spans)
    packed_modules_mapping: dict[str, tuple[str, int | tuple[int, ...]]] = {}
    # an encoder (bidirectional, no LM head) is only pooled: model/pooler.py
    is_encoder = False

    def __init__(self, cfg: ArchConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = torch.get_default_dtype()  # the activations' (load_model sets it)

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor maps to, or None to skip it."""
        return name

    @classmethod
    def kv_cache_spec(cls, cfg: ArchConfig, layer: int) -> KVCacheSpec:
        """What `layer` caches per token: by default K and V of this rank's KV heads (tensor
        parallel: its share, or one replicated head); nothing for a layer of linear attention
        (its state is kept per request: model/layers/gated_delta_net.py)."""
        if layer in cfg.linear_layers:
            return NO_KV
        return KVCacheSpec(2, local_heads(cfg.num_heads, cfg.num_kv_heads)[1], cfg.head_dim)

    def linear_name(self, ckpt_name: str) -> str | None:
        """The module (a packed Linear for q/k/v and gate/up) that checkpoint tensor fills."""
        name = self.checkpoint_name(ckpt_name)
        if name is None:
            return None
        module = name.rpartition(".")[0]
        owner, _, leaf = module.rpartition(".")
        if leaf in self.packed_modules_mapping:
            packed = self.packed_modules_mapping[leaf][0]
            module = f"{owner}.{packed}" if owner else packed
        return module

    def convert_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """Reshape or transpose a checkpoint tensor into this model's layout (`name` is ours)."""
        return tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors in; returns the names of the parameters that were filled."""
        params = dict(self.named_parameters())
        modules = dict(self.named_modules())
        loaded: set[str] = set()
        slots: dict[str, set[int]] = {}  # packed parameter -> slots filled so far
        experts: dict[str, set[str]] = {}  # MoE layer -> expert tensors filled so far
        for ckpt_name, tensor in weights:
            name = self.checkpoint_name(ckpt_name)
            if name is None:
                continue
            tensor = self.convert_tensor(name, tensor)
            m = EXPERT_TENSOR.match(name)
            if m and hasattr(modules.get(f"{m[1]}.experts"), "load_expert"):
                moe = modules[f"{m[1]}.experts"]
                filled = moe.load_expert(int(m[2]), m[3], tensor, m[4])
                if filled is not None:  # None: another expert-parallel rank's
                    experts.setdefault(f"{m[1]}.experts", set()).add(filled)
                continue
            module_name, _, kind = name.rpartition(".")
            owner, leaf = module_name.rsplit(".", 1) if "." in module_name else ("", module_name)
            target, slot = module_name, None  # a Linear's own tensor: every slot at once
            if leaf in self.packed_modules_mapping:
                packed, slot = self.packed_modules_mapping[leaf]
                target = f"{owner}.{packed}" if owner else packed
            if hasattr(modules.get(target), "load_shard"):  # weight, bias, qweight, scales, ...
                modules[target].load_shard(kind, slot, tensor)
                filled = slots.setdefault(f"{target}.{kind}", set())
                filled.update(range(len(modules[target].shards)) if slot is None
                              else slot if isinstance(slot, tuple) else [slot])
                if len(filled) == len(modules[target].shards):
                    loaded.add(f"{target}.{kind}")
                continue
            attn = modules.get(f"{module_name}.attn")
            if kind in ("k_scale", "v_scale") and hasattr(attn, "set_kv_scale"):
                attn.set_kv_scale(kind, tensor)  # an fp8 checkpoint's KV-cache scales
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {ckpt_name} has no place in "
                                 f"{type(self).__name__}")
            param = params[name]
            loader = getattr(param, "weight_loader", None)  # cuts a rank's share (vocab rows)
            if loader is not None:
                try:
                    loader(param, tensor)
                except ValueError as exc:
                    raise ValueError(f"{ckpt_name}: {exc}") from None
            elif param.shape != tensor.shape:
                raise ValueError(f"{ckpt_name}: checkpoint shape {tuple(tensor.shape)}, "
                                 f"model shape {tuple(param.shape)}")
            else:
                param.data.copy_(tensor)
            loaded.add(name)
        for moe, filled in experts.items():
            if len(filled) == modules[moe].num_expert_tensors():
                # dense experts' (none if quantized), and biases where they have them
                loaded.update({f"{moe}.w13", f"{moe}.w2", f"{moe}.w13_bias", f"{moe}.w2_bias"})
        missing = {n for n, _ in self.named_parameters()} - loaded  # quantizing removed some
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        for module in modules.values():
            if hasattr(module, "process_after_load"):
                module.process_after_load()
        return loaded


class EncoderModel(CheckpointModel):
    """A bidirectional encoder (BERT, ModernBERT): each of a step's sequences is whole in it
    (the scheduler sees to that) and attends only to itself; nothing is cached, and there is
    no LM head: it is only pooled."""

    is_encoder = True
    classifier_token = "cls"  # what a classifier head reads (model/pooler.py)

    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        where = parallel_state.placement()
        if where.pp_size > 1 or where.cp_size > 1:
            raise NotImplementedError(f"an encoder ({type(self).__name__}) over pipeline "
                                      f"stages or context-parallel ranks; tensor parallelism "
                                      f"works")
        if max_positions > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len ({max_positions}) exceeds the "
                             f"{cfg.max_position_embeddings} positions the encoder learned")


class CausalLM(CheckpointModel):
    final_logit_softcap: float | None = None
    logit_scale: float = 1.0  # the logits times this (Cohere's logit_scale, Granite's 1 / scaling)

    def make_lm_head(self, embedding: Embedding) -> LMHead:
        """The output projection, sharing `embedding`'s weights when the config ties them."""
        tied = embedding if self.cfg.tie_word_embeddings else None
        return LMHead(self.cfg.vocab_size, self.cfg.hidden_size, tied)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden] (a pipeline stage before the
        last: its layers' output, sent on to the next stage)"""
        return run_stage(self.model, input_ids, positions, self.cfg.hidden_size, self.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self.logit_scale != 1.0:
            logits = logits * self.logit_scale
        if self.final_logit_softcap:
            logits = torch.tanh(logits / self.final_logit_softcap) * self.final_logit_softcap
        return logits

    def checkpoint_name(self, name: str) -> str | None:
        """The parameter name a checkpoint tensor maps to, or None to skip it."""
        if "rotary_emb" in name or (name == "lm_head.weight" and self.cfg.tie_word_embeddings):
            return None
        # ModelOpt writes the KV-cache scales on the projections (k_proj.k_scale): the layer's
        if name.endswith((".k_proj.k_scale", ".v_proj.v_scale")):
            projection, _, scale = name.rpartition(".")
            name = f"{projection.rpartition('.')[0]}.{scale}"
        return local_layer_name(name, self.cfg.num_layers)
