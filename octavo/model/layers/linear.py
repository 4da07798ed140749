"""Linear layers whose weights may be packed from several checkpoint tensors (q/k/v, gate/up),
and their tensor-parallel forms.

The weights belong to the layer's `quant_method` (octavo/model/quant/base.py), which loads the
checkpoint's tensors and, once they are all in, gives the layer one typed weights object
(`weights`, quant/weights.py): dense, maybe with a low-bit copy for small batches (a GGUF's
codes), or packed int4/int8 alone (a quantized checkpoint, --quantization). Its type is its
kernel, chosen then, so `forward` is one call on it. The bias stays dense.

Tensor parallelism shards a layer as its checkpoint tensors come in (`load_shard`), before the
quant method sees them, so each rank only ever holds its own slice: a column-parallel layer
(`column_parallel`, `qkv_parallel`) keeps its rows of every packed slot, a row-parallel one
(`row_parallel`) its columns, and sums its partial output over the tensor-parallel ranks. The
quant method says which dimension of each of its tensors is the output and which the input
(`QuantMethod.tensor_dims`), so codes, scales and packed formats shard by the same rule.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from octavo.distributed import parallel_state
from octavo.model.context import step_lora
from octavo.model.layers.opaque import call_opaque
from octavo.model.quant.base import UNQUANTIZED, Loading, QuantMethod
from octavo.model.quant.weights import LinearWeights


@dataclass(frozen=True)
class Span:
    """This rank's rows (or columns) [start, start + width) of a checkpoint dimension `full`."""

    start: int
    width: int
    full: int

    @classmethod
    def whole(cls, full: int) -> Span:
        return cls(0, full, full)

    def take(self, tensor: torch.Tensor, dim: int | None, what: str) -> torch.Tensor:
        """The span of `tensor` along `dim`, scaled to that dimension's size (a scale per 32
        inputs spans a 32nd as many columns)."""
        if dim is None or self.width == self.full or tensor.dim() <= dim:
            return tensor
        size = tensor.shape[dim]
        if size == 1:  # one value for the whole dimension (a per-tensor scale): every rank's
            return tensor
        if (self.start * size) % self.full or (self.width * size) % self.full:
            raise ValueError(f"{what}: dimension {dim} of size {size} does not split into this "
                             f"rank's share [{self.start}, {self.start + self.width}) of "
                             f"{self.full}; lower tensor_parallel_size")
        return tensor.narrow(dim, self.start * size // self.full, self.width * size // self.full)


class Linear(nn.Module):
    """y = x W^T (+ b). `shards` are the output widths of the checkpoint tensors packed in W (this
    rank's). `slot_spans`: each slot's rows in its checkpoint tensor (None: all of them);
    `input_span`: this rank's columns, the output then summed over the tensor-parallel ranks."""

    def __init__(self, in_features: int, shards: list[int], bias: bool = False,
                 slot_spans: list[Span] | None = None, input_span: Span | None = None,
                 reduce: bool = True) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = shards
        self.slot_spans = slot_spans
        self.input_span = input_span
        # Settled at construction, so a step only reads a flag: with `reduce` False the caller
        # sums the partial outputs (an MoE's experts).
        self.sums_output = reduce and self.splits_input
        self.lora = None  # the adapters' slots (model/layers/lora.py), where LoRA is on
        self.bias = nn.Parameter(torch.zeros(sum(shards)), requires_grad=False) if bias else None
        self.set_quant_method(UNQUANTIZED)

    @property
    def splits_input(self) -> bool:
        return self.input_span is not None and self.input_span.width < self.input_span.full

    @property
    def splits_packed_tensor(self) -> bool:
        """A checkpoint tensor spanning every slot is cut into its slots before loading."""
        return self.slot_spans is not None and len(self.shards) > 1 and any(
            s.width < s.full for s in self.slot_spans)

    def set_quant_method(self, method: QuantMethod) -> None:
        """Before loading: hand the weights to `method` (creates what they load into)."""
        self._parameters.pop("weight", None)
        self.loading: Loading | None = None
        self.weights: LinearWeights | None = None  # set once loaded
        self.quant_method = method
        method.create_weights(self)

    @property
    def weights_shape(self) -> tuple[int, int]:
        return sum(self.shards), self.in_features

    def set_weights(self, weights: LinearWeights) -> None:
        """The finished weights (by the quant method, or read back from prepared weights):
        they replace what the checkpoint's tensors were loaded into."""
        if weights.shape != self.weights_shape:
            raise ValueError(f"weights of shape {weights.shape} for a linear layer of "
                             f"{self.weights_shape}")
        self._parameters.pop("weight", None)
        self.loading = None
        self.weights = weights

    def load_shard(self, name: str, index: int | tuple[int, ...] | None,
                   tensor: torch.Tensor) -> None:
        """Checkpoint tensor `name` (weight, bias, qweight, scales, ...) of packed slot `index`
        (None: a tensor spanning all slots; a tuple: one spanning those consecutive slots),
        whole: this rank's part is cut here."""
        out_dim, in_dim = (0, None) if name == "bias" else self.quant_method.tensor_dims(name)
        if isinstance(index, tuple) or (index is None and self.splits_packed_tensor):
            slots = range(len(self.shards)) if index is None else index
            fulls = [self.slot_spans[i].full if self.slot_spans else self.shards[i]
                     for i in slots]
            start = 0
            for slot, full in zip(slots, fulls):
                self.load_shard(name, slot, Span(start, full, sum(fulls)).take(
                    tensor, out_dim, f"{name} of a packed layer"))
                start += full
            return
        if self.slot_spans is not None:
            spans = self.slot_spans if index is None else [self.slot_spans[index]]
            if len(spans) == 1:
                tensor = spans[0].take(tensor, out_dim, name)
        if self.input_span is not None:
            tensor = self.input_span.take(tensor, in_dim, name)
            if name == "g_idx" and self.splits_input:  # groups counted from this rank's first
                tensor = tensor - tensor.min()
        if name != "bias":
            self.quant_method.load_shard(self, name, index, tensor)
            return
        if self.bias is None:
            raise ValueError("checkpoint has a bias this layer was built without")
        start = sum(self.shards[:index]) if index is not None else 0
        width = self.shards[index] if index is not None else sum(self.shards)
        dest = self.bias.data.narrow(0, start, width)
        if dest.shape != tensor.shape:
            raise ValueError(f"shape mismatch: checkpoint bias {tuple(tensor.shape)}, "
                             f"layer slot {tuple(dest.shape)}")
        dest.copy_(tensor)

    def process_after_load(self) -> None:
        if self.weights is None:  # on-the-fly quantization finishes a layer while loading
            self.quant_method.process_after_load(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compiled graphs call it whole: a product's kernel is chosen by its rows and its weights'
        # kind, and the adapters by the step, which traced would make a graph (and guards) each.
        return call_opaque(self, x)

    def empty_output(self, x: torch.Tensor) -> torch.Tensor:
        return x.new_empty(*x.shape[:-1], sum(self.shards))

    def eager_forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weights.matmul(x)
        if self.lora is not None and (lora := step_lora()) is not None:
            y = self.lora.add_delta(x, y, lora.token_slot, lora.slots)  # partial sums, as y's
        if self.sums_output:
            y = parallel_state.tp_all_reduce(y)
        return y if self.bias is None else y + self.bias


def even_span(full: int, what: str) -> Span:
    """This rank's equal share of `full` rows or columns."""
    size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
    if full % size:
        raise ValueError(f"{what} ({full}) is not divisible by tensor_parallel_size {size}")
    return Span(rank * full // size, full // size, full)


def column_parallel(in_features: int, shards: list[int], bias: bool = False,
                    what: str = "output width") -> Linear:
    """Each packed slot's rows split evenly over the tensor-parallel ranks."""
    spans = [even_span(width, what) for width in shards]
    return Linear(in_features, [s.width for s in spans], bias, slot_spans=spans)


def row_parallel(in_features: int, out_features: int, bias: bool = False,
                 what: str = "input width", reduce: bool = True) -> Linear:
    """The input columns split evenly; the partial outputs summed over the ranks (by the caller
    with `reduce` False)."""
    span = even_span(in_features, what)
    return Linear(span.width, [out_features], bias, input_span=span, reduce=reduce)


@dataclass(frozen=True)
class HeadShare:
    """This rank's attention heads: query heads [q_first, q_first + q_heads) and the KV heads
    [kv_first, kv_first + kv_heads) they read, each KV head serving q_heads // kv_heads of them."""

    q_first: int
    q_heads: int
    kv_first: int
    kv_heads: int


def head_share(num_heads: int, num_kv_heads: int) -> HeadShare:
    """KV heads (with their query heads) split over the ranks as evenly as they go: 9 query heads
    over 3 KV heads give two ranks 1 and 2 KV heads, never a query head without its KV head in the
    cache. With fewer KV heads than ranks each rank keeps one KV head and an equal share of its
    query heads."""
    size, rank = parallel_state.tp_size(), parallel_state.tp_rank()
    if num_heads % num_kv_heads:
        raise ValueError(f"num_attention_heads ({num_heads}) is not a multiple of "
                         f"num_key_value_heads ({num_kv_heads})")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        first, end = rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size
        return HeadShare(first * group, (end - first) * group, first, end - first)
    if size % num_kv_heads or group % (size // num_kv_heads):
        raise ValueError(f"tensor_parallel_size {size} cannot split {num_kv_heads} KV heads of "
                         f"{group} query heads each: use a size that divides "
                         f"num_key_value_heads, or a multiple of it that divides the query heads")
    ranks_per_kv = size // num_kv_heads
    kv, part = divmod(rank, ranks_per_kv)
    heads = group // ranks_per_kv
    return HeadShare(kv * group + part * heads, heads, kv, 1)


def local_heads(num_heads: int, num_kv_heads: int) -> tuple[int, int]:
    """This rank's query and KV heads (`head_share`)."""
    share = head_share(num_heads, num_kv_heads)
    return share.q_heads, share.kv_heads


def qkv_parallel(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, query_parts: int = 1) -> Linear:
    """q, k and v packed, split by heads (`head_share`); each head's q rows may hold
    `query_parts` parts of head_dim (Qwen3-Next: its query, then its output gate)."""
    share = head_share(num_heads, num_kv_heads)
    width = query_parts * head_dim
    q = Span(share.q_first * width, share.q_heads * width, num_heads * width)
    kv = Span(share.kv_first * head_dim, share.kv_heads * head_dim, num_kv_heads * head_dim)
    return Linear(hidden_size, [q.width, kv.width, kv.width], bias, slot_spans=[q, kv, kv])


def heads_output(head_dim: int, num_heads: int, num_kv_heads: int, out_features: int,
                 bias: bool = False) -> Linear:
    """The attention output projection, row-parallel over this rank's query heads."""
    share = head_share(num_heads, num_kv_heads)
    span = Span(share.q_first * head_dim, share.q_heads * head_dim, num_heads * head_dim)
    return Linear(span.width, [out_features], bias, input_span=span)
