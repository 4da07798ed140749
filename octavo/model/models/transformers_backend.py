"""The transformers backend: a decoder-only `*ForCausalLM` that octavo has no native file for
(or any, with --model-impl transformers) runs through transformers' own modeling code, with
octavo's paged attention plugged in through transformers' attention-function interface, and
octavo's scheduler, KV cache, sampler and server around it (as vLLM's Transformers backend).

- The model is transformers' class built from the folder's config. Each step's tokens go in
  as one row of a batch of one, with their own positions; each attention layer hands its
  rotated q, k and v to a `PagedAttention` of its own, which writes the KV cache and attends
  as the step's plan says. No mask is built: the plan is the mask.
- Its `nn.Linear` layers (the LM head too) are octavo's `Linear`, so they take quantized
  checkpoints, `--quantization` and the CPU's packed GEMM as native files do.
- The logits are the model's own head code (scaling, soft-capping) run over the rows the
  sampler asks for: the base model is stood in for by those rows for the call.
- A model whose code cannot take an external attention function is refused, naming it, as
  are tensor and pipeline parallelism and LoRA."""
from __future__ import annotations

import torch
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.distributed import parallel_state
from octavo.model.layers.attention import PagedAttention
from octavo.model.layers.linear import Linear
from octavo.model.models.base import CausalLM
from octavo.model.registry import causal_lm_architectures, supported_architectures

ATTENTION = "octavo_paged"  # octavo's name in transformers' attention and mask interfaces


def backend_class(architecture: str) -> type:
    """transformers' class for a decoder-only `architecture` the backend can run; else
    NotImplementedError naming why."""
    import transformers

    if architecture not in causal_lm_architectures():
        raise NotImplementedError(
            f"architecture {architecture!r} has no native file in octavo and is not a "
            f"decoder-only causal LM of transformers {transformers.__version__}; native: "
            f"{', '.join(supported_architectures())}")
    cls = getattr(transformers, architecture)
    if not cls.is_backend_compatible():
        raise NotImplementedError(
            f"architecture {architecture!r}: transformers' code for it cannot take an external "
            f"attention function (its _supports_attention_backend is False), so the "
            f"transformers backend cannot run it")
    return cls


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None,
               dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over octavo's paged attention: q [1, H, T,
    D], k and v [1, KVH, T, D], rotated -> [1, T, H, D]."""
    paged: PagedAttention | None = getattr(module, "octavo_attention", None)
    if paged is None:
        raise NotImplementedError(f"{type(module).__name__} has no layer index octavo knows: "
                                  f"the transformers backend cannot give it a KV cache")
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError(f"{type(module).__name__}: attention sinks in the "
                                  f"transformers backend")
    if kwargs.get("sliding_window") and paged.sliding_window is None:
        raise NotImplementedError(f"{type(module).__name__} slides over a window its config "
                                  f"does not declare per layer (layer_types, sliding_window)")
    if scaling is not None:
        paged.scale = scaling
    paged.softcap = kwargs.get("softcap") or None
    q, k, v = (x[0].transpose(0, 1).contiguous() for x in (query, key, value))
    if k.shape[1] != paged.num_kv_heads or k.shape[2] != paged.head_dim:
        raise ValueError(f"{type(module).__name__} gives {k.shape[1]} KV heads of {k.shape[2]} "
                         f"features; the KV cache was sized from config.json for "
                         f"{paged.num_kv_heads} of {paged.head_dim}")
    out = paged(q, k, v)  # [T, H * D]
    return out.view(1, q.shape[0], q.shape[1], -1), None


def _no_mask(*args, **kwargs) -> None:
    """The step's plan masks (each request sees only its own tokens, causally): none built."""
    return None


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, _attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


class _RowsLinear(Linear):
    """octavo's Linear over transformers' [batch, tokens, features] activations."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], -1)


class _GivenRows(nn.Module):
    """Stands in for the base model while the head alone runs: its output is what it is given."""

    def forward(self, inputs_embeds: torch.Tensor, **kwargs):
        from transformers.modeling_outputs import BaseModelOutputWithPast

        return BaseModelOutputWithPast(last_hidden_state=inputs_embeds)


class TransformersForCausalLM(CausalLM):
    def __init__(self, cfg: ArchConfig, max_positions: int) -> None:
        super().__init__(cfg)
        where = parallel_state.placement()
        if where.tp_size > 1 or where.pp_size > 1 or where.cp_size > 1:
            raise NotImplementedError(f"{cfg.architecture} through the transformers backend "
                                      f"with tensor, pipeline or context parallelism")
        cls = backend_class(cfg.architecture)
        import transformers

        _register()
        config = transformers.AutoConfig.for_model(**cfg.extra)
        config.tie_word_embeddings = cfg.tie_word_embeddings
        self.hf = cls._from_config(config, attn_implementation=ATTENTION,
                                   dtype=torch.get_default_dtype())
        self._swap_linears(cfg.tie_word_embeddings)
        self._give_attention(cfg)
        self.given_rows = _GivenRows()

    def _swap_linears(self, tied: bool) -> None:
        head = self.hf.get_output_embeddings()
        for parent in list(self.hf.modules()):
            for name, child in list(parent.named_children()):
                if type(child) is nn.Linear and not (tied and child is head):
                    setattr(parent, name, _RowsLinear(child.in_features, [child.out_features],
                                                      bias=child.bias is not None))

    def _give_attention(self, cfg: ArchConfig) -> None:
        """Each attention module (it has a layer_idx) its own slice of the paged KV cache."""
        for module in self.hf.modules():
            index = getattr(module, "layer_idx", None)
            if type(module).__name__.endswith("Attention") and isinstance(index, int):
                scale = getattr(module, "scaling", None) or cfg.head_dim ** -0.5
                module.octavo_attention = PagedAttention(
                    index, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, scale,
                    cfg.layer_window(index))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        out = self.hf.base_model(input_ids=input_ids[None], position_ids=positions[None],
                                 use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's own head over these rows (its logit scaling or soft-capping included):
        its forward runs with the base model stood in for by the rows."""
        prefix = self.hf.base_model_prefix
        base = getattr(self.hf, prefix)
        setattr(self.hf, prefix, self.given_rows)
        try:
            return self.hf(inputs_embeds=hidden[None], use_cache=False).logits[0]
        finally:
            setattr(self.hf, prefix, base)

    def checkpoint_name(self, name: str) -> str | None:
        name = super().checkpoint_name(name)
        return None if name is None else f"hf.{name}"
