"""The worker's adapters: which adapter sits in which of the `max_loras` device slots, an LRU of
`max_cpu_loras` adapters loaded in host memory, and each step's token slots (model/layers/
lora.py).

The scheduler never runs requests of more adapters at once than there are slots (core/
scheduler.py), so a step finds a slot for each of its adapters: one already there, an empty one,
or one whose adapter no running request uses. An adapter's tensors are read once into host
memory (in the model's dtype, B scaled) and copied into a slot when a step needs it; loading one
never touches the slots the step's other adapters use, so their requests compute as before.
"""
from __future__ import annotations

import logging
import re
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from octavo.arch_config import ArchConfig
from octavo.config import LoRAConfig
from octavo.lora.adapter import AdapterSpec, LoRATarget, expert_projection, read_adapter
from octavo.model.layers.embedding import Embedding, LMHead
from octavo.model.layers.linear import Linear
from octavo.model.layers.lora import (LoRASlots, LoRAStep, expert_slots, linear_slots,
                                      set_expert_pair, set_linear_pair)
from octavo.model.layers.moe import FusedMoE
from octavo.params import LoRARequest

logger = logging.getLogger(__name__)

# The base model's linear layers an adapter may change (the packed names octavo's families
# give q/k/v and gate/up), and the two vocabulary layers.
_ADAPTED_LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                    "mlp.down_proj", "shared_expert.gate_up_proj", "shared_expert.down_proj")
_LAYER_PREFIX = re.compile(r"^(model\.layers\.\d+)\.(.+)$")


@dataclass
class LoadedAdapter:
    """An adapter in host memory: per module it changes, (module, packed index, A, scaled B)."""

    spec: AdapterSpec
    pairs: list[tuple[str, int | None, torch.Tensor, torch.Tensor]]


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, arch: ArchConfig,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.arch = arch
        self.dtype, self.device = dtype, device
        self.slot_adapter = [0] * config.max_loras  # adapter id in each slot, 0: empty
        self.loaded: OrderedDict[int, LoadedAdapter] = OrderedDict()  # LRU, oldest first
        self.requests: dict[int, LoRARequest] = {}  # every adapter a request has named
        self.layers: dict[str, tuple[nn.Module, LoRASlots]] = {}
        self.moe_of: dict[str, str] = {}  # model.layers.<n> -> its FusedMoE's name
        slots, rank = config.max_loras, config.max_lora_rank
        for name, module in model.named_modules():
            if isinstance(module, Linear) and name.endswith(_ADAPTED_LINEARS) \
                    and ".experts." not in name:
                module.lora = linear_slots(module, slots, rank, dtype, device)
            elif isinstance(module, LMHead):
                module.lora = LoRASlots([0, module.weights_shape[0]], module.weights_shape[1],
                                        slots, rank, dtype, device)
            elif isinstance(module, Embedding):
                module.lora = LoRASlots([0, module.weights_shape[1]], arch.vocab_size, slots,
                                        rank, dtype, device, embedding=True)
            elif isinstance(module, FusedMoE):
                module.lora = expert_slots(module, slots, rank, dtype, device)
                self.moe_of[_LAYER_PREFIX.match(name)[1]] = name
                for e, (gate_up, down) in enumerate(module.lora, module.first_expert):
                    self.layers[f"{name}.{e}.gate_up"] = (module, gate_up)
                    self.layers[f"{name}.{e}.down"] = (module, down)
                continue
            else:
                continue
            self.layers[name] = (module, module.lora)
        size = sum(s.a.nbytes + s.b.nbytes for _, s in self.layers.values())
        logger.info("LoRA: %d adapter slots of rank up to %d on %d layers (%.1f MB), %d "
                    "adapters kept in host memory", slots, rank, len(self.layers), size / 1e6,
                    config.cpu_slots)

    def register(self, request: LoRARequest) -> None:
        """A request names this adapter: remember where it is (loaded when a step needs it).
        An id names one adapter for the engine's life (lora/registry.py holds the front end to
        it), so what is loaded under an id stays valid."""
        self.requests[request.lora_int_id] = request

    def step(self, token_lora: np.ndarray) -> LoRAStep | None:
        """Each token's slot, with every adapter in the step placed in one. token_lora: each
        token's adapter id (0: none)."""
        ids = np.unique(token_lora)
        ids = ids[ids > 0]
        if not len(ids):
            return None
        slot_of = self._place([int(i) for i in ids])
        return LoRAStep(slots_of(token_lora, slot_of).to(self.device), slot_of,
                        sorted(slot_of.values()))

    def _place(self, ids: list[int]) -> dict[int, int]:
        needed = set(ids)
        slot_of = {a: s for s, a in enumerate(self.slot_adapter) if a in needed}
        free = [s for s, a in enumerate(self.slot_adapter) if a not in needed]
        for lora_id in ids:
            if lora_id in slot_of:
                continue
            if not free:
                raise RuntimeError(f"a step with {len(ids)} adapters, above max_loras "
                                   f"{self.config.max_loras}")
            slot = free.pop(0)
            self._fill(slot, self._host(lora_id))
            slot_of[lora_id] = slot
        return slot_of

    def _host(self, lora_id: int) -> LoadedAdapter:
        adapter = self.loaded.get(lora_id)
        if adapter is None:
            adapter = self._load(self.requests[lora_id])
            self.loaded[lora_id] = adapter
            while len(self.loaded) > self.config.cpu_slots:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(lora_id)
        return adapter

    def _load(self, request: LoRARequest) -> LoadedAdapter:
        spec = read_adapter(request, self.arch, self.config.max_lora_rank)
        pairs = []
        with safe_open(str(spec.weights_path), framework="pt") as f:
            for target in spec.targets:
                expert = self._expert_of(target.module)
                where = self._module_of(target.module) if expert is None else expert
                if where is None:  # another pipeline stage's layer
                    continue
                a = f.get_tensor(target.a_name).to(torch.float32)
                b = f.get_tensor(target.b_name).to(torch.float32) * target.scaling
                for name, index, a_part, b_part in _split(where, target, a, b):
                    if name in self.layers:  # not an expert another rank holds
                        pairs.append((name, index, a_part.to(self.dtype), b_part.to(self.dtype)))
        logger.info("LoRA adapter %r (id %d, rank %d, %d modules) loaded from %s",
                    request.lora_name, request.lora_int_id, spec.rank, len(pairs),
                    request.lora_path)
        return LoadedAdapter(spec, pairs)

    def _module_of(self, module: str) -> tuple[str, int | None] | None:
        """The octavo module (and packed index) a checkpoint module name maps to."""
        if module == "lm_head":
            return next(((n, None) for n, (m, _) in self.layers.items()
                         if isinstance(m, LMHead)), None)
        name = self.model.linear_name(f"{module}.weight")
        if name is None or name not in self.layers:
            return None
        leaf = module.rpartition(".")[2]
        packed = self.model.packed_modules_mapping.get(leaf)
        return name, None if packed is None else packed[1]

    def _expert_of(self, module: str) -> tuple[str, int | None, str] | None:
        """(this stage's FusedMoE, expert or None for all, projection) of an expert target."""
        m = _LAYER_PREFIX.match(module)
        found = None if m is None else expert_projection(m[2])
        if found is None:
            return None
        local = self.model.checkpoint_name(f"{module}.weight")
        if local is None:
            return None
        return self.moe_of[_LAYER_PREFIX.match(local)[1]], found[0], found[1]

    def _fill(self, slot: int, adapter: LoadedAdapter) -> None:
        self._clear(slot)
        for name, index, a, b in adapter.pairs:
            module, slots = self.layers[name]
            if isinstance(module, FusedMoE):
                set_expert_pair(module, slots, slot, index, a, b)
            elif isinstance(module, Linear):
                set_linear_pair(module, slots, slot, index, a, b)
            elif isinstance(module, LMHead):
                first = module.first_row
                rows = b[first:first + module.weights_shape[0]]
                slots.set(slot, 0, (0, rows.shape[0]), a, rows)
            else:  # the embedding: A [rank, vocab], B [hidden, rank]
                slots.set(slot, 0, (0, b.shape[0]), a, b)
        self.slot_adapter[slot] = adapter.spec.request.lora_int_id

    def _clear(self, slot: int) -> None:
        for _, slots in self.layers.values():
            slots.clear(slot)
        self.slot_adapter[slot] = 0


def _split(where: tuple, target: LoRATarget, a: torch.Tensor, b: torch.Tensor
           ) -> list[tuple[str, int | None, torch.Tensor, torch.Tensor]]:
    """A target's pairs as the slots take them: (layer, packed index, A, scaled B). An expert
    target becomes its experts' gate_up (index 0 gate, 1 up) and down (None) pairs; a pair
    stacked over every expert, one per expert (a stacked gate_up's A serves gate and up)."""
    if len(where) == 2:
        return [(*where, a, b)]
    moe, expert, proj = where
    if expert is None:
        experts, rank = target.experts, target.rank
        a_of = a.reshape(experts, rank, a.shape[1])
        b_of = b.reshape(b.shape[0], rank, experts)
        pairs = [(e, a_of[e], b_of[:, :, e]) for e in range(experts)]
    else:
        pairs = [(expert, a, b)]
    out = []
    for e, a_e, b_e in pairs:
        if proj == "gate_up":
            width = b_e.shape[0] // 2
            out += [(f"{moe}.{e}.gate_up", 0, a_e, b_e[:width]),
                    (f"{moe}.{e}.gate_up", 1, a_e, b_e[width:])]
        else:
            name = f"{moe}.{e}.{'down' if proj == 'down' else 'gate_up'}"
            out.append((name, {"gate": 0, "up": 1, "down": None}[proj], a_e, b_e))
    return out


def slots_of(lora_of: np.ndarray, slot_of: dict[int, int]) -> torch.Tensor:
    """Each row's slot (-1: no adapter), from its adapter id (lora_of: 0 for none, else one
    of slot_of's)."""
    table = np.full(max(slot_of) + 1, -1, np.int64)
    table[list(slot_of)] = list(slot_of.values())
    return torch.from_numpy(table[lora_of])
