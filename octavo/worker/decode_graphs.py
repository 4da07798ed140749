"""CUDA graphs of decode steps: the model's forward over a step in which every request brings
one token, captured once per (batch size, context length) bucket and replayed with the step's
inputs copied into the graph's static buffers.

A small model's decode step on a GPU is a few hundred kernel launches of a few microseconds of
work each: launched from Python, the launches are the step. A replayed graph launches them all
at once. What a graph replays must have fixed shapes and no host synchronization, so a graph's
step takes its requests padded to a bucket of `cudagraph_capture_sizes` (the padding rows: token
0 at position 0, every block the scratch block past the core's, so their keys and values land
where no request reads) and its attention over a context bucket (a power of two of blocks, at
least 16): each row's keys gathered through its block table up to the bucket, the ones past its
position masked. The masks, the cache slots and the keys' slots are computed in the graph from
the step's token ids, positions and block tables, which are the only inputs copied in.

With LoRA on, each row's adapter slot is an input too, and the layers add every slot's delta
masked to its rows (LoRAStep with no slot list): one graph serves every mix of adapters.

Graphs are captured in the engine's idle work (Worker.do_idle_work: when the engine next idles,
or before the next step of one that stays busy), one a call, for the buckets that steps have
needed: start-up never waits on a
capture, and a step whose bucket has no graph yet runs eagerly. A capture that fails turns the
graphs off with a warning (the engine goes on eagerly). `--enforce-eager` turns them off.
Models whose decode step reads the device's data on the host (mixtures of experts, but for bf16
stacked experts on an sm90/sm100 GPU, where their grouped GEMMs count on the device; linear
attention finds each request's state by its batch row), or
whose step spans ranks (tensor, pipeline and context parallelism, whose collectives inside a
captured graph are unchecked), run eagerly, and the start says why.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from octavo.kernels.paged_attention import AttentionGroup, AttentionPlan
from octavo.model.context import ForwardContext, forward_context
from octavo.model.layers.lora import LoRAStep
from octavo.model.layers.moe import FusedMoE

logger = logging.getLogger(__name__)

# A step's forward as a function of the graph's static buffers -> a callable that replays it and
# returns its (static) output.
Capture = Callable[[Callable[[], torch.Tensor]], Callable[[], torch.Tensor]]
MIN_CONTEXT_BLOCKS = 16  # the smallest context bucket: 256 tokens at the default block size
# Longer contexts run eagerly (vLLM's max_seq_len_to_capture): a graph's attention gathers each
# row's keys up to its bucket, so the largest graph's memory grows with it.
MAX_CAPTURED_CONTEXT = 8192


class CudaCapture:
    """Captures into torch.cuda.CUDAGraphs sharing one memory pool. Sharing is safe here: the
    graphs never run concurrently, each graph's output stays allocated (so no later capture
    reuses it), and a step reads its output before the next replay."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def __call__(self, forward: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # lazy initializations (cuBLAS handles) outside it
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = forward()

        def replay() -> torch.Tensor:
            graph.replay()
            return out
        return replay


def capturer(device: torch.device) -> Capture | None:
    """How decode graphs are captured on `device`; None where it has no graphs (the CPU's
    analogue is the C++ decode stack, model/decode_stack.py)."""
    return CudaCapture() if device.type == "cuda" else None


def usable_sizes(sizes: tuple[int, ...], max_num_seqs: int) -> tuple[int, ...]:
    """`sizes` without those a step never needs: past the first that holds max_num_seqs rows
    (the memory plan reserves the largest graph's memory)."""
    holds = [s for s in sizes if s >= max_num_seqs]
    return tuple(s for s in sizes if s < max_num_seqs) + tuple(holds[:1])


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default buckets (1, 2, 4, then every 8 up to 512), up to the batch's rows."""
    largest = min(max_num_seqs, 512)
    return tuple(s for s in (1, 2, 4, *range(8, 513, 8)) if s < largest) + (largest,)


def refusal(model: nn.Module, device: torch.device, tp_size: int, pp_size: int, cp_size: int,
            attention_chunk: int | None) -> str | None:
    """Why this model's decode steps cannot be captured on `device`, or None."""
    if tp_size > 1 or pp_size > 1 or cp_size > 1:
        return "a step over several ranks (its collectives inside a captured graph are unchecked)"
    if any(isinstance(m, FusedMoE) and not m.grouped(device) for m in model.modules()):
        return ("its mixture-of-experts layers read their experts' row counts on the host (a "
                "graph holds them as grouped GEMMs: bf16 stacked experts on an sm90/sm100 GPU)")
    if any(hasattr(m, "restore_states") for m in model.modules()):
        return "its linear-attention layers find each request's state on the host"
    if attention_chunk is not None:
        return "chunked local attention"
    return None


class DecodeGraphs:
    def __init__(self, model: nn.Module, device: torch.device, capture: Capture,
                 sizes: tuple[int, ...], block_size: int, max_blocks: int,
                 sliding_window: int | None, lora: bool = False) -> None:
        """sizes: the batch buckets (sorted; none past the first that holds max_num_seqs, the
        worker's clamp); max_blocks: a request's blocks at full length;
        lora: the model's layers hold adapter slots (each row's slot is an input too)."""
        self.model, self.device, self.capture, self.lora = model, device, capture, lora
        self.sizes = sizes
        self.block_size, self.max_blocks = block_size, max_blocks
        self.sliding_window = sliding_window
        self.kv_caches: list[torch.Tensor] = []
        self.scratch_block = -1  # set by bind()
        # (rows, blocks) -> (static inputs [rows, 3 + blocks] int64: token id, position,
        # adapter slot, block table; replay)
        self.graphs: dict[tuple[int, int], tuple[torch.Tensor, Callable[[], torch.Tensor]]] = {}
        self.wanted: dict[tuple[int, int], None] = {}  # buckets steps needed, not yet captured
        self.replays = 0
        self.failed: str | None = None  # why a capture failed: no graphs from then on

    def bind(self, kv_caches: list[torch.Tensor], scratch_block: int) -> None:
        """The KV caches the graphs read and write, and the block past the core's that takes
        the padding rows' keys and values."""
        self.kv_caches, self.scratch_block = kv_caches, scratch_block

    def bucket(self, num_rows: int, longest: int) -> tuple[int, int] | None:
        """The graph of `num_rows` one-token requests of at most `longest` tokens of context;
        None past the largest batch bucket or MAX_CAPTURED_CONTEXT."""
        if num_rows > self.sizes[-1] or longest > MAX_CAPTURED_CONTEXT or self.failed:
            return None
        rows = next(s for s in self.sizes if s >= num_rows)
        needed = -(-longest // self.block_size)
        blocks = MIN_CONTEXT_BLOCKS
        while blocks < needed:
            blocks *= 2
        return rows, min(blocks, self.max_blocks)

    def largest_bucket(self) -> tuple[int, int]:
        """The bucket whose graph holds the most memory."""
        return self.bucket(self.sizes[-1], min(MAX_CAPTURED_CONTEXT,
                                               self.max_blocks * self.block_size))

    def padding_step(self, key: tuple[int, int]) -> torch.Tensor:
        """`key`'s step over padding rows only, run eagerly: what its graph holds
        (worker/memory.py profiles it)."""
        return self._forward(self._padding(key))

    def _padding(self, key: tuple[int, int]) -> torch.Tensor:
        """Static inputs of padding rows only: a graph is captured over these, so its writes
        go where no request reads."""
        return torch.from_numpy(self._padding_rows(*key)).to(self.device)

    def _padding_rows(self, rows: int, blocks: int) -> np.ndarray:
        """`rows` padding rows of the static inputs, on the host: token 0 at position 0, no
        adapter, every block the scratch block."""
        host = np.full((rows, 3 + blocks), self.scratch_block, np.int64)
        host[:, :3] = (0, 0, -1)
        return host

    def ready(self, key: tuple[int, int]) -> bool:
        """Whether `key` has a graph; if not, it is captured at the next idle work."""
        if key in self.graphs:
            return True
        self.wanted[key] = None
        return False

    def run(self, key: tuple[int, int], token_ids: np.ndarray, positions: np.ndarray,
            tables: np.ndarray, lora_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states of a decode step of len(token_ids) requests through `key`'s
        graph; tables: their block tables (at least key's blocks wide); lora_slots: each
        request's adapter slot (-1: none), None where none has one."""
        static, replay = self.graphs[key]
        blocks = key[1]
        n = len(token_ids)
        host = self._padding_rows(*key)
        host[:n, 0], host[:n, 1], host[:n, 3:] = token_ids, positions, tables[:, :blocks]
        static.copy_(torch.from_numpy(host))
        if lora_slots is not None:
            static[:n, 2].copy_(lora_slots)
        self.replays += 1
        return replay()[:n]

    def capture_wanted(self) -> bool:
        """Capture one bucket that a step needed; whether more wait."""
        if not self.wanted:
            return False
        key = next(iter(self.wanted))
        del self.wanted[key]
        rows, blocks = key
        static = self._padding(key)
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                replay = self.capture(lambda: self._forward(static))
        except Exception as exc:  # (a step the refusals missed): the engine goes on eagerly
            self.failed = f"{type(exc).__name__}: {exc}"
            self.wanted.clear()
            logger.warning("CUDA graphs turned off: capturing the decode step of %d requests "
                           "failed (%s); decode steps run eagerly", rows, self.failed)
            return False
        self.graphs[key] = (static, replay)
        logger.info("CUDA graph of decode steps of up to %d requests over up to %d tokens "
                    "captured in %.2f s (%d graphs)", rows, blocks * self.block_size,
                    time.perf_counter() - start, len(self.graphs))
        return bool(self.wanted)

    def _forward(self, static: torch.Tensor) -> torch.Tensor:
        """The step over the static inputs, in fixed shapes and without reading the device's
        data on the host: what a graph captures."""
        rows, blocks = static.shape[0], static.shape[1] - 3
        bs = self.block_size
        token_ids, positions, tables = static[:, 0], static[:, 1], static[:, 3:]
        slots = tables.gather(1, (positions // bs)[:, None]).squeeze(1) * bs + positions % bs
        offsets = torch.arange(bs, device=static.device)
        key_slots = (tables[:, :, None] * bs + offsets).reshape(rows, blocks * bs)
        context = torch.arange(blocks * bs, device=static.device)
        visible = context[None, :] <= positions[:, None]
        token_index = torch.arange(rows, device=static.device)[:, None]

        def plan(mask: torch.Tensor) -> AttentionPlan:
            return AttentionPlan(rows, slots, [AttentionGroup(token_index, None, key_slots,
                                                              mask[:, None, None, :])])

        sliding = None
        if self.sliding_window is not None:
            sliding = plan(visible & (context[None, :] > positions[:, None]
                                      - self.sliding_window))
        lora = LoRAStep(static[:, 2], {}, None) if self.lora else None
        with forward_context(ForwardContext(plan(visible), self.kv_caches, sliding, lora)):
            return self.model(token_ids, positions)
