"""Mixture of experts: top-k routing and the experts' gated MLPs computed grouped by expert.

Tokens are sorted by the expert they were routed to, so each expert runs one matmul over all of
its tokens (a loop over experts, never over tokens; on sm90/sm100 GPUs two grouped GEMMs), then
the outputs are weighted and summed back per token with one index_add. Quantized experts (a
GPTQ/AWQ/FP8 checkpoint's, or --quantization) become one `Linear` per expert and projection
(gate/up packed, down), each with the quant method any other linear layer gets, replacing the
stacked dense tensors; so do dense bf16 experts once loaded, as views of them, where oneDNN
packs bf16 weights (`split_for_packing`).

Under tensor parallelism every rank holds every expert's share of the intermediate width (gate and
up rows, down columns: `even_span`); under expert parallelism (--enable-expert-parallel) a rank
holds whole experts, num_experts / (tensor x context parallel size x data-parallel replicas)
consecutive ones. Ranks that
hold the same tokens (a tensor-parallel group) each compute the rows routed to their experts,
and the layer's output is summed over them once, after the experts' outputs are combined. With
context-parallel ranks or replicas, which may hold different tokens (those of a split step, or
each replica's own batch), rows go to their experts' ranks and back with all-to-alls
(`_dispatched`), then are summed over the tensor-parallel group: each context-parallel rank's
rows come back to it alone, so its tokens' routing is its own, even in a step every rank
computes whole.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from octavo.distributed import parallel_state
from octavo.kernels import onednn
from octavo.model.context import step_lora, step_real_rows
from octavo.model.layers.activation import gated_act
from octavo.model.layers.linear import Linear, Span, column_parallel, even_span, row_parallel
from octavo.model.layers.opaque import call_opaque
from octavo.model.layers.routing import Routing
from octavo.model.quant.base import QuantMethod
from octavo.model.quant.weights import DenseWeights

# checkpoint projection name -> (packed parameter, slot): Mixtral's w1/w3/w2 and Qwen's names
_PROJ = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
         "w2": ("w2", 0), "down_proj": ("w2", 0)}
# <block>.experts.<index>.<projection>.<kind: weight, or a quantized format's qweight, scales...>
EXPERT_TENSOR = re.compile(r"^(.*)\.experts\.(\d+)\.(\w+)\.(\w+)$")
# Devices whose MoE layers compute their stacked experts as two grouped GEMMs (`_grouped`); the
# CPU keeps its loop over the experts and its C++ decode stack.
GROUPED_DEVICES = ("cuda",)


def grouped_gemm_on_device(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm reads no offset on the host there (CUTLASS's bf16 kernels on
    sm90/sm100; elsewhere it loops over the groups from the host): a CUDA graph can hold it."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device)[0] in (9, 10))


class FusedMoE(nn.Module):
    """`act`: the gated activation on [gate | up] where the family has its own (gpt-oss), else
    hidden_act's; `bias`: each expert's projections have biases (gpt-oss), which stay dense
    here, beside quantized weights too; `routing`: the family's own (DeepSeek's sigmoid scores
    and expert groups, Llama 4's), else softmax top-k, renormalized or not; `weigh_inputs`: a
    row's routing weight scales the expert's input rather than its output (Llama 4)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 hidden_act: str, renormalize: bool, bias: bool = False,
                 act: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 routing: Routing | None = None, weigh_inputs: bool = False) -> None:
        super().__init__()
        self.weigh_inputs = weigh_inputs
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {num_experts}], got {top_k}")
        self.routing = routing or Routing(top_k, renormalize)
        if self.routing.top_k != top_k:
            raise ValueError(f"the routing's top_k ({self.routing.top_k}) is not the layer's "
                             f"({top_k})")
        if num_experts % self.routing.groups:
            raise ValueError(f"n_group ({self.routing.groups}) does not divide the "
                             f"{num_experts} experts")
        self.num_experts, self.top_k = num_experts, top_k
        ranks = parallel_state.ep_size()
        if num_experts % ranks:
            raise ValueError(f"num_experts ({num_experts}) is not divisible by the "
                             f"expert-parallel size {ranks} (tensor_parallel_size x the "
                             f"context-parallel size x the replicas the experts span)")
        self.num_local = num_experts // ranks  # this rank's experts: [first_expert, + num_local)
        self.first_expert = parallel_state.ep_rank() * self.num_local
        self.full_intermediate_size = intermediate_size
        self.span = (even_span(intermediate_size, "moe_intermediate_size") if ranks == 1 else
                     Span(0, intermediate_size, intermediate_size))
        intermediate_size = self.intermediate_size = self.span.width
        # [local experts, 2 * I, H]: gate rows then up rows; [local experts, H, I]: down
        self.w13 = nn.Parameter(torch.empty(self.num_local, 2 * intermediate_size, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local, hidden_size, intermediate_size),
                               requires_grad=False)
        self.hidden_size = hidden_size
        self.act = act or gated_act(hidden_act)
        self.w13_bias = self.w2_bias = None
        if bias:
            self.w13_bias = nn.Parameter(torch.zeros(self.num_local, 2 * intermediate_size),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(self.num_local, hidden_size),
                                        requires_grad=False)
        # A row's down bias joins once: on one rank of a tensor-parallel group that splits each
        # expert's width (each computes part of every row), on every rank that holds whole
        # experts (each row is computed by one of them)
        self._adds_down_bias = ranks > 1 or parallel_state.tp_rank() == 0
        # per expert: [gate_up, down] Linears (quantized experts, or dense bf16 ones to be
        # packed: split_for_packing), in place of w13 and w2
        self.expert_linears: nn.ModuleList | None = None
        # per expert: its gate_up's and down's adapter slots (model/layers/lora.py), where LoRA
        # is on
        self.lora: list | None = None
        # Under expert parallelism, the rows routed to each expert since the worker last read
        # them (routed_per_rank): every rank routes every token alike, so one rank's count is
        # every rank's load. The decode stack adds to it too.
        self.routed = torch.zeros(num_experts, dtype=torch.long) if ranks > 1 else None

    def quantize_experts(self, method_for: Callable[[Linear], QuantMethod | None]) -> int:
        """Before loading: per-expert Linears with `method_for`'s methods replace w13 and w2
        (left dense when it has none for them). Returns the number of quantized Linears."""
        hidden, inter = self.w13.shape[2], self.full_intermediate_size
        what = "moe_intermediate_size"

        def pair() -> nn.ModuleList:
            if parallel_state.ep_size() > 1:  # whole experts, summed with the others' once
                return nn.ModuleList([Linear(hidden, [inter, inter]), Linear(inter, [hidden])])
            return nn.ModuleList([column_parallel(hidden, [inter, inter], what=what),
                                  row_parallel(inter, hidden, what=what, reduce=False)])
        experts = [pair() for _ in range(self.num_local)]
        methods = [method_for(layer) for layer in experts[0]]
        if any(m is None for m in methods):
            return 0
        for pair in experts:
            for layer, method in zip(pair, methods):
                layer.set_quant_method(method)
        self.expert_linears = nn.ModuleList(experts)
        del self.w13, self.w2
        return 2 * self.num_local

    def load_expert(self, expert: int, proj: str, tensor: torch.Tensor,
                    kind: str = "weight") -> str | None:
        """Copy one expert's gate, up or down tensor in; returns the slot it went to (None: an
        expert another rank holds, left unread)."""
        if proj not in _PROJ or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert tensor {expert}.{proj} has no place in this MoE layer "
                             f"({self.num_experts} experts)")
        if self.local_expert(expert) is None:
            return None
        expert -= self.first_expert
        name, slot = _PROJ[proj]
        if kind == "bias":
            return self._load_bias(expert, name, slot, tensor, proj)
        if self.expert_linears is not None:
            self.expert_linears[expert][name == "w2"].load_shard(kind, slot, tensor)
            return f"{name}.{expert}.{slot}"
        if kind != "weight":
            raise ValueError(f"expert tensor {expert}.{proj}.{kind} on unquantized experts")
        self._copy_in(self.w13, self.w2, expert, name, slot, tensor, f"expert {expert}.{proj}")
        return f"{name}.{expert}.{slot}"

    def _load_bias(self, expert: int, name: str, slot: int, tensor: torch.Tensor,
                   proj: str) -> str:
        if self.w13_bias is None:
            raise ValueError(f"expert tensor {expert}.{proj}.bias: this MoE layer's experts "
                             f"have no biases")
        self._copy_in(self.w13_bias, self.w2_bias, expert, name, slot, tensor,
                      f"expert {expert}.{proj}.bias")
        return f"{name}_bias.{expert}.{slot}"

    def _copy_in(self, gate_up: torch.Tensor, down: torch.Tensor, expert: int, name: str,
                 slot: int, tensor: torch.Tensor, what: str) -> None:
        """An expert's gate or up tensor into its slot of `gate_up`'s rows, or its down tensor
        into `down` (weights or biases), cut to this rank's share of the intermediate width."""
        i = self.intermediate_size
        if name == "w2":  # the width is the down weight's columns (a bias has none)
            dest, tensor = down.data[expert], self.span.take(tensor, 1, what)
        else:
            dest = gate_up.data[expert, slot * i:(slot + 1) * i]
            tensor = self.span.take(tensor, 0, what)
        if dest.shape != tensor.shape:
            raise ValueError(f"{what}: checkpoint shape {tuple(tensor.shape)}, layer shape "
                             f"{tuple(dest.shape)}")
        dest.copy_(tensor)

    def local_expert(self, expert: int) -> int | None:
        """Expert `expert`'s index among this rank's, None where another rank holds it."""
        local = expert - self.first_expert
        return local if 0 <= local < self.num_local else None

    def routed_per_rank(self) -> list[int]:
        """The rows routed to each expert-parallel rank's experts since the last call (which
        resets the count)."""
        per_rank = self.routed.view(-1, self.num_local).sum(1).tolist()
        self.routed.zero_()
        return per_rank

    def split_for_packing(self) -> None:
        """Dense bf16 experts become one Linear per expert and projection, over views of the
        stacked weights, so that each takes the dense weights' oneDNN packing as any linear
        layer does (model/loader/gemm_packing.py: the same products, bit for bit, sooner; a
        plain weight is reordered at every product). Float32 experts, and CPUs without bf16
        packing, keep the stacked weights."""
        if self.expert_linears is not None or not onednn.packable(self.w13[0]):
            return
        hidden, inter = self.hidden_size, self.intermediate_size
        experts = []
        for e in range(self.num_local):
            gate_up, down = Linear(hidden, [inter, inter]), Linear(inter, [hidden])
            gate_up.set_weights(DenseWeights(self.w13[e].detach()))
            down.set_weights(DenseWeights(self.w2[e].detach()))
            experts.append(nn.ModuleList([gate_up, down]))
        self.expert_linears = nn.ModuleList(experts)
        del self.w13, self.w2

    def num_expert_tensors(self) -> int:
        return (3 if self.w13_bias is None else 6) * self.num_local

    def expert_weights(self) -> list[tuple[Linear | torch.Tensor, Linear | torch.Tensor]]:
        """This rank's experts' gate_up and down projections, as forward computes them: their
        Linears (quantized or packable experts), or their slices of the stacked dense
        weights."""
        if self.expert_linears is not None:
            return [(gate_up, down) for gate_up, down in self.expert_linears]
        return [(self.w13[e], self.w2[e]) for e in range(self.num_local)]

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x: [T, H], router_logits: [T, E] -> [T, H]. The C++ decode stack
        (csrc/decode_stack.h, moe) runs these same ops in this order."""
        return call_opaque(self, x, router_logits)  # compiled graphs: its rows depend on data

    def empty_output(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)  # x's dtype, not the logits' (a float32 router's)

    def eager_forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, experts = self.routing(router_logits)  # [T, k]
        if parallel_state.ep_dispatches():
            return self._dispatched(x, weights, experts)
        if self.grouped(x.device):
            return self._grouped(x, weights, experts)
        flat = experts.reshape(-1)  # [T * k]
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        if self.routed is not None:  # every rank routes every token alike
            self.routed += counts
        counts = counts.tolist()
        first = self.first_expert  # this rank's experts' rows: a run of the sorted ones
        begin = sum(counts[:first])
        order = order[begin:begin + sum(counts[first:first + self.num_local])]
        counts = counts[first:first + self.num_local]
        token = order // self.top_k  # the token each sorted row came from
        weight = weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
        xs = x.index_select(0, token)
        if self.weigh_inputs:
            ys = self._experts(xs * weight, counts, token)
        else:
            ys = self._experts(xs, counts, token) * weight
        return parallel_state.tp_all_reduce(torch.zeros_like(x).index_add_(0, token, ys))

    def grouped(self, device: torch.device) -> bool:
        """Whether the experts run as grouped GEMMs on `device` (a CUDA graph holds them):
        stacked, local, no LoRA, 16-byte rows, where torch's kernel reads no offset on the host."""
        if (device.type not in GROUPED_DEVICES or self.expert_linears is not None
                or self.lora is not None or self.num_local != self.num_experts):
            return False
        size = self.w13.element_size()
        return (self.hidden_size * size % 16 == 0 and self.intermediate_size * size % 16 == 0
                and grouped_gemm_on_device(device, self.w13.dtype))

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor,
                 experts: torch.Tensor) -> torch.Tensor:
        """The loop's products as two grouped GEMMs over the rows sorted by expert, each
        expert's run ending at its offset, counted on the device (no host read)."""
        flat = experts.reshape(-1)  # [T * k]
        order = flat.argsort(stable=True)
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        offsets = counts.cumsum(0).to(torch.int32)
        token, expert = order // self.top_k, flat[order]
        weight = weights.reshape(-1)[order].unsqueeze(1).to(x.dtype)
        xs = x.index_select(0, token)
        if self.weigh_inputs:
            xs = xs * weight
        h = torch._grouped_mm(xs, self.w13.transpose(1, 2), offs=offsets)
        if self.w13_bias is not None:
            h = h + self.w13_bias[expert]
        y = torch._grouped_mm(self.act(h), self.w2.transpose(1, 2), offs=offsets)
        if self.w2_bias is not None and self._adds_down_bias:
            y = y + self.w2_bias[expert]
        if not self.weigh_inputs:
            y = y * weight
        return parallel_state.tp_all_reduce(torch.zeros_like(x).index_add_(0, token, y))

    def _experts(self, xs: torch.Tensor, counts: list[int],
                 token: torch.Tensor | None) -> torch.Tensor:
        """xs [rows, H], grouped by this rank's experts (counts[e] rows for its e-th) -> each
        row's expert output. token: each row's token in the step, for its adapter."""
        ys = torch.empty_like(xs)
        lora = step_lora() if self.lora is not None and token is not None else None
        row_slot = None if lora is None else lora.token_slot.index_select(0, token)
        start = 0
        for e, n in enumerate(counts):
            if n:
                rows = xs[start:start + n]
                if self.expert_linears is not None:
                    gate_up, down = self.expert_linears[e]
                    h = gate_up(rows)
                else:
                    h = rows @ self.w13[e].t()
                if self.w13_bias is not None:
                    h = h + self.w13_bias[e]
                if lora is not None:  # each row's adapter's delta of this expert's projections
                    h = self.lora[e][0].add_delta(rows, h, row_slot[start:start + n], lora.slots)
                h = self.act(h)
                y = down(h) if self.expert_linears is not None else h @ self.w2[e].t()
                if self.w2_bias is not None and self._adds_down_bias:
                    y = y + self.w2_bias[e]
                if lora is not None:
                    y = self.lora[e][1].add_delta(h, y, row_slot[start:start + n], lora.slots)
                ys[start:start + n] = y
                start += n
        return ys

    def _dispatched(self, x: torch.Tensor, weights: torch.Tensor,
                    experts: torch.Tensor) -> torch.Tensor:
        """Each routed row to the rank holding its expert, computed there, and back: an
        exchange of counts and two all-to-alls (rows with their experts; outputs)."""
        tp = parallel_state.tp_size()
        flat = experts.reshape(-1)  # [T * k]
        dest = flat // self.num_local  # the ep rank holding each row's expert
        # A tensor-parallel group's ranks hold the same tokens: tp rank t sends the rows bound
        # for the ranks of tp index t, so each row goes out once and comes back to one rank.
        # A split step's padding rows (model/context_parallel.own_rows) go nowhere.
        sent = dest % tp == parallel_state.tp_rank()
        real = step_real_rows()
        if real is not None:
            sent &= torch.arange(len(flat), device=flat.device) < real * self.top_k
        mine = torch.nonzero(sent).flatten()
        mine = mine[dest[mine].argsort(stable=True)]
        send = torch.bincount(dest[mine], minlength=parallel_state.ep_size()).tolist()
        token = mine // self.top_k
        weight = weights.reshape(-1)[mine].unsqueeze(1).to(x.dtype)
        sent_rows = x.index_select(0, token)
        if self.weigh_inputs:
            sent_rows = sent_rows * weight
        (rows, local), recv, matrix = parallel_state.ep_all_to_all(
            [sent_rows, flat[mine] - dest[mine] * self.num_local], send)
        by_expert = local.argsort(stable=True)
        counts = torch.bincount(local, minlength=self.num_local)
        self.routed[self.first_expert:self.first_expert + self.num_local] += counts
        ys = torch.empty_like(rows)
        ys[by_expert] = self._experts(rows.index_select(0, by_expert), counts.tolist(), None)
        (back,), _, _ = parallel_state.ep_all_to_all([ys], recv, matrix.t())
        if not self.weigh_inputs:
            back = back * weight
        return parallel_state.tp_all_reduce(torch.zeros_like(x).index_add_(0, token, back))


class FloatRouter(nn.Module):
    """A router in float32 whatever the model's dtype (as DeepSeek computes it), with an
    optional score correction bias (DeepSeek V3's, which its Routing reads)."""

    def __init__(self, hidden: int, experts: int, correction: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(experts, dtype=torch.float32), requires_grad=False)
            if correction else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


def exchange_without_rows(mixtures: list[FusedMoE], dtype: torch.dtype,
                          device: torch.device) -> None:
    """A forward pass with no tokens, as far as the other replicas see it: each MoE layer in
    order sends no rows to the exchanges and computes the rows sent to its experts (a replica
    with nothing to run, while its experts serve the others': distributed/lockstep.py)."""
    for m in mixtures:
        m(torch.empty(0, m.hidden_size, dtype=dtype, device=device),
          torch.empty(0, m.num_experts, device=device))


def tokens_per_rank(mixtures: list[FusedMoE]) -> list[int]:
    """The rows each expert-parallel rank computed in these MoE layers since the last call.
    Collective where rows are dispatched: each rank counted those it computed, and one
    all-reduce sums every layer's counts. Where the experts span replicas, a replica reports
    its own ranks' rows alone (the others report theirs), so that the replicas' sum is each
    rank's."""
    if parallel_state.ep_dispatches():
        counts = parallel_state.ep_all_reduce(torch.stack([m.routed for m in mixtures]))
        for m, summed in zip(mixtures, counts):
            m.routed.copy_(summed)
    loads = [m.routed_per_rank() for m in mixtures]
    per_rank = [sum(rank) for rank in zip(*loads)]
    mine = parallel_state.placement().replica_ep_ranks()
    return [n if rank in mine else 0 for rank, n in enumerate(per_rank)]
