"""A worker: device and threads, model loading, KV-cache allocation, step execution."""
from __future__ import annotations

import logging
import os
import time

import torch

from octavo.arch_config import ArchConfig, read_arch_config
from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.distributed import parallel_state
from octavo.distributed.parallel_state import RankPlacement
from octavo.distributed.placement import bind_rank_cpus
from octavo.kernels import fused
from octavo.kernels.attention_backend import AttentionBackend
from octavo.kernels.context_parallel import ContextParallel
from octavo.model import compiled, decode_stack
from octavo.model.kv_spec import KVCacheSpec
from octavo.model.layers.moe import FusedMoE, exchange_without_rows, tokens_per_rank
from octavo.model.loader import load_model
from octavo.model.loader.gemm_packing import StepwisePacking
from octavo.model.pipeline import stage_range
from octavo.model.registry import model_class
from octavo.model_source import ModelSource, cache_dir, resolve_model
from octavo.platform import cpu_platform
from octavo.worker import decode_graphs, memory
from octavo.worker.decode_graphs import DecodeGraphs
from octavo.worker.lora import LoRAManager
from octavo.worker.model_runner import ModelRunner
from octavo.worker.spec.draft import DraftModel

logger = logging.getLogger(__name__)


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str]:
    """The compute dtype `dtype` ("auto", "float32", "bfloat16") means on `device`, and why."""
    if dtype in ("float32", "bfloat16"):
        return getattr(torch, dtype), "asked for"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, "the GPU computes bf16"
        return torch.float16, "the GPU has no bf16"
    name, why = cpu_platform().auto_dtype()
    return getattr(torch, name), why


class Worker:
    """One rank's worker. With `placement.global_world_size` > 1 it joins the other ranks at
    `distributed_init_method` (tcp://host:port) before anything is loaded, and holds its share of
    the model (tensor parallel: its heads and slices; pipeline parallel: its layers).
    `local_rank` of `local_world_size` is its place among the ranks on this machine (default:
    every rank is on this machine), which decides its share of the cores and its device."""

    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int],
                 placement: RankPlacement = RankPlacement(0),
                 distributed_init_method: str | None = None, local_rank: int | None = None,
                 local_world_size: int | None = None) -> None:
        local_rank = placement.rank if local_rank is None else local_rank
        local_world_size = placement.world_size if local_world_size is None else local_world_size
        self.config = config
        self.placement = placement
        self.source = source
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.device = torch.device(config.device.device)
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device: cuda was asked for but torch sees no CUDA device")
        if self.device.type == "cuda" and placement.world_size > 1:  # one device per local rank
            self.device = torch.device("cuda", local_rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        # the GPU's free memory before anything is loaded (memory.py)
        self.free_at_start = (torch.cuda.mem_get_info(self.device)[0]
                              if self.device.type == "cuda" else 0)
        self.gpu_plan: memory.GpuPlan | None = None
        # Ranks on this machine each get their own cores and as many threads (distributed/
        # placement.py); one process takes them all.
        if self.device.type != "cpu" or bind_rank_cpus(
                local_rank, local_world_size, config.parallel.cpu_binding,
                config.device.num_threads) is None:
            torch.set_num_threads(config.device.num_threads or len(os.sched_getaffinity(0)))
        if placement.global_world_size > 1:
            if distributed_init_method is None:
                raise ValueError("a worker of a parallel world needs distributed_init_method")
            parallel_state.init(placement, distributed_init_method,
                                "nccl" if self.device.type == "cuda" else "gloo")
        self.dtype, why = resolve_dtype(config.model.dtype, self.device)
        if placement.rank == 0:
            logger.info("dtype %s: %s", str(self.dtype).removeprefix("torch."), why)

        self.kv_dtype = {"auto": self.dtype, "bfloat16": torch.bfloat16,
                         "fp8_e4m3": torch.float8_e4m3fn}[config.cache.kv_cache_dtype]
        self.arch = arch
        self.runner: ModelRunner | None = None
        self.packing: StepwisePacking | None = None  # the dense weights' packing, until done
        self.draft_arch: ArchConfig | None = None  # speculative decoding's draft model
        self.routed_by: list[FusedMoE] = []  # MoE layers counting their routing (expert parallel)

    def _log_quantized_activations(self) -> None:
        """dtype auto's plan for packed weights' activations on this CPU (Int4Packed)."""
        plan = []
        if fused.int4_int16_gemm_ready(self.dtype):
            plan.append("int16 for decode batches (every batch for 8-bit codes)")
        if fused.int4_int8_gemm_ready(self.dtype):
            plan.append("int8 for large batches (prefill)")
        if plan:
            logger.info("packed weights take their activations quantized to %s per 32 inputs: "
                        "dtype auto's plan on this CPU; an explicit --dtype computes them "
                        "exactly", " and ".join(plan))

    def load_model(self) -> None:
        fused.enable_native(self.config.device.native_kernels if self.device.type == "cpu"
                            else "off")
        start = time.perf_counter()
        quantization = self.config.model.quantization
        # On the CPU the dense weights are packed for oneDNN's GEMM a few at a time, while idle
        # and before each step (the engine is ready 0.15 s sooner; see gemm_packing).
        model = load_model(self.source, self.arch, self.dtype, self.device, self.max_model_len,
                           self.config.model.decode_weights, quantization, pack_gemm=False,
                           dense_prefill=self.config.model.dense_prefill_weights,
                           quantized_activations=self.config.model.dtype == "auto",
                           model_impl=self.config.model.model_impl)
        logger.info("loaded %s (%s, %s) in %.1f s", self.source.name, self.arch.architecture,
                    self.dtype, time.perf_counter() - start)
        if self.placement.rank == 0 and self.config.model.dtype == "auto":
            self._log_quantized_activations()
        mixtures = [m for m in model.modules() if isinstance(m, FusedMoE)]
        self.routed_by = [m for m in mixtures if m.routed is not None]  # expert parallelism
        if mixtures and parallel_state.ep_size() > 1:
            moe = mixtures[0]
            logger.info("expert parallel: rank %d of %d holds experts %d-%d of %d (whole) in each "
                        "of its %d MoE layers", parallel_state.ep_rank(), parallel_state.ep_size(),
                        moe.first_expert, moe.first_expert + moe.num_local - 1, moe.num_experts,
                        len(mixtures))
        if self.device.type == "cpu" and not self.config.device.enforce_eager \
                and not model.is_encoder:
            decode_stack.attach(model)
        if self.device.type == "cpu":
            self.packing = StepwisePacking(model, quantization)
        level = self.config.device.compilation_level
        if level and not model.is_encoder:
            compiled.compile_layers(model, level, str(cache_dir() / "compile"),
                                    self.arch.hidden_size, self.dtype, self.device)
        elif level:
            logger.info("compilation level %d: %s is an encoder, whose forward runs eagerly "
                        "(only decoder layers are compiled)", level, self.arch.architecture)
        sched = self.config.scheduler
        self.runner = ModelRunner(
            model, self.device, sched.max_num_seqs, self.max_model_len,
            self.config.core_block_size, self.arch.vocab_size, self.config.device.seed,
            self.arch.sliding_window, self._context_parallel(), self.arch.attention_chunk_size)
        if self.config.lora.enable_lora:
            self.runner.lora = LoRAManager(model, self.config.lora, self.arch, self.dtype,
                                           self.device)
        spec = self.config.speculative
        if spec is not None and spec.method == "draft_model":
            self.runner.drafter = self._load_draft(spec.model, spec.num_speculative_tokens)
        self.runner.graphs = self._decode_graphs(model)
        backend = AttentionBackend.select(self.config.device.attention_backend, self.device)
        self.runner.attention_backend = backend
        if self.runner.drafter is not None:
            self.runner.drafter.attention_backend = backend
        if self.placement.rank == 0 and not model.is_encoder:
            logger.info("attention: %s (%s)", backend.name, backend.describe())

    def _decode_graphs(self, model: torch.nn.Module) -> DecodeGraphs | None:
        """CUDA graphs of the decode steps, where the device captures graphs and the model's
        step can be one (the start says why not)."""
        capture = decode_graphs.capturer(self.device)
        if capture is None or self.config.device.enforce_eager or model.is_encoder:
            return None
        p = self.placement
        why = decode_graphs.refusal(model, self.device, p.tp_size, p.pp_size, p.cp_size,
                                    self.arch.attention_chunk_size)
        if why is not None:
            if p.rank == 0:
                logger.info("decode steps run eagerly, without CUDA graphs: %s", why)
            return None
        rows = self.config.scheduler.max_num_seqs
        sizes = decode_graphs.usable_sizes(self.config.device.cudagraph_capture_sizes
                                           or decode_graphs.default_capture_sizes(rows), rows)
        block_size = self.config.core_block_size
        return DecodeGraphs(model, self.device, capture, sizes, block_size,
                            -(-self.max_model_len // block_size), self.arch.sliding_window,
                            lora=self.config.lora.enable_lora)

    def _context_parallel(self) -> ContextParallel | None:
        parallel = self.config.parallel
        if parallel.context_parallel_size == 1:
            return None
        split_tokens = parallel.prefill_context_parallel_size > 1
        shard_kv = parallel.decode_context_parallel_size > 1
        if self.placement.rank == 0:
            logger.info("context parallel over %d ranks: %s", parallel.context_parallel_size,
                        " and ".join(what for what, on in (
                            ("prompt steps' tokens split", split_tokens),
                            ("each request's KV blocks split", shard_kv)) if on))
        return ContextParallel(parallel.context_parallel_size, self.placement.cp_rank,
                               split_tokens, shard_kv, self.config.cache.block_size)

    def _load_draft(self, name: str, k: int) -> DraftModel:
        if self.placement.pp_size > 1:
            raise NotImplementedError("speculative_config.model with pipeline_parallel_size > 1: "
                                      "the draft model runs on no stage yet")
        try:
            source = resolve_model(name)
            arch = read_arch_config(source)
        except ValueError as exc:
            raise ValueError(f"speculative_config.model: {exc}") from None
        if arch.vocab_size != self.arch.vocab_size:
            raise ValueError(f"speculative_config.model {name!r} has a vocabulary of "
                             f"{arch.vocab_size} tokens, the target {self.arch.vocab_size}: a "
                             f"draft model must share the target's tokenizer")
        if self.arch.all_layers_sliding:
            raise ValueError("speculative_config.model: a draft model with a target whose every "
                             "layer slides (blocks behind the window are freed) is not supported")
        start = time.perf_counter()
        model = load_model(source, arch, self.dtype, self.device, self.max_model_len,
                           self.config.model.decode_weights,
                           dense_prefill=self.config.model.dense_prefill_weights,
                           quantized_activations=self.config.model.dtype == "auto")
        logger.info("loaded draft model %s (%s, %d layers) in %.1f s", name, arch.architecture,
                    arch.num_layers, time.perf_counter() - start)
        if self.device.type == "cpu" and not self.config.device.enforce_eager:
            decode_stack.attach(model)  # its k - 1 single-token steps are decode steps
        self.draft_arch = arch
        return DraftModel(model, self.device, k, self.config.cache.block_size,
                          self.config.device.seed, arch.sliding_window,
                          arch.attention_chunk_size)

    def _kv_layers(self) -> list[KVCacheSpec]:
        """What each KV layer caches: the target's layers on this pipeline stage, then the
        draft model's (same blocks), each as its model class describes them."""
        if self.arch.is_encoder:
            return []
        target = model_class(self.arch.architecture, self.config.model.model_impl)
        layers = [target.kv_cache_spec(self.arch, i) for i in stage_range(self.arch.num_layers)]
        if self.draft_arch is not None:
            draft = model_class(self.draft_arch.architecture)
            layers += [draft.kv_cache_spec(self.draft_arch, i)
                       for i in range(self.draft_arch.num_layers)]
        return layers

    def describe(self) -> str:
        quantization = self.config.model.quantization or ("GGUF's own" if self.source.is_gguf
                                                          else "none")
        kernels = ("C++ kernels" if fused.native_ready() else
                   "PyTorch ops" if self.device.type == "cpu" else self.device.type)
        return (f"{self.arch.architecture}, {str(self.dtype).removeprefix('torch.')}, "
                f"quantization {quantization}, {kernels}")

    def _rank_block(self, block_size: int) -> int:
        """The tokens of a core block of `block_size` this rank caches (decode context
        parallelism: a share)."""
        return block_size // self.config.parallel.decode_context_parallel_size

    def kv_bytes_per_block(self, block_size: int) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        block_size = self._rank_block(block_size)
        return sum(spec.bytes_per_block(block_size, elem) for spec in self._kv_layers())

    def available_memory(self) -> int | None:
        """Bytes the KV cache could take: on a GPU, what gpu_memory_utilization leaves for it
        (the plan of memory.py, made at the first call); elsewhere the memory available."""
        if self.device.type == "cuda" and self._kv_layers():  # (an encoder caches nothing)
            if self.gpu_plan is None:
                self.gpu_plan = self._plan_gpu_memory()
            return self.gpu_plan.kv_cache
        free = memory.available_memory(self.device)
        return None if free is None else free[0]

    def _plan_gpu_memory(self) -> memory.GpuPlan:
        """Profile the largest step and decode graph into a temporary KV cache of their blocks
        (and the graphs' scratch block), then plan."""
        sched, block_size = self.config.scheduler, self.config.core_block_size
        tokens = min(sched.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // block_size)
        # recurrent states (batch row 0's are used): allocated now, but the executor takes
        # their bytes out of the plan's budget itself (blocks_in_budget), so not held here
        states = 0
        if self._state_plan():
            states = self._allocate_states()
        caches = self._caches(blocks + 1, block_size)[:len(stage_range(self.arch.num_layers))]
        activations = memory.peak_of(self.device, lambda: self.runner.largest_step(
            caches, tokens, sched.max_num_seqs))
        graphs, graph_bytes = self.runner.graphs, 0
        if graphs is not None:
            bound = graphs.kv_caches, graphs.scratch_block
            graphs.bind(caches, scratch_block=blocks)
            with torch.inference_mode():
                graph_bytes = memory.peak_of(
                    self.device, lambda: graphs.padding_step(graphs.largest_bucket()))
            graphs.bind(*bound)
        caches.clear()  # freed before the plan reads the GPU's free memory
        plan = memory.plan(self.device, self.config.kv_memory_fraction,
                           self.free_at_start + states, activations, graph_bytes)
        if self.placement.rank == 0:
            logger.info("%s", plan.describe(self.device, tokens))
        return plan

    def state_bytes(self) -> int:
        """Bytes of the recurrent states of this rank's linear-attention layers, which come out
        of the KV cache's budget (`_state_plan`)."""
        return sum(layer.state_bytes(self.dtype, *shape) for layer, shape in self._state_plan())

    def _state_plan(self) -> list[tuple[torch.nn.Module, tuple[int, int, int]]]:
        """Each linear-attention layer with its (batch rows, checkpoint slots, longest verified
        span): the target's layers hold a state per batch row, a slot per saved state of prefix
        caching and span buffers under speculative decoding; a draft model's hold those slots
        too, and one more per batch row, where its request resumes at the next step
        (worker/spec/draft.py)."""
        rows, saved = self.config.scheduler.max_num_seqs, self.config.state_checkpoint_slots
        spec = self.config.speculative
        span = 0 if spec is None else 1 + spec.num_speculative_tokens
        plan = [(m, (rows, saved, span)) for m in self.runner.model.modules()
                if hasattr(m, "allocate_state")]
        if self.runner.drafter is not None:
            plan += [(m, (rows, saved + rows, 0)) for m in self.runner.drafter.model.modules()
                     if hasattr(m, "allocate_state")]
        return plan

    def init_kv_cache(self, num_blocks: int, block_size: int) -> int:
        """Allocate `num_blocks` KV blocks (executor/base.py's blocks_in_budget fitted them
        beside state_bytes on every rank) and the linear-attention states; returns the blocks.
        With no rank caching anything (0 blocks), an encoder's blocks are only a count."""
        if not num_blocks and not self._kv_layers():
            return self.config.scheduler.max_num_seqs * -(-self.max_model_len // block_size)
        graphs = self.runner.graphs
        scratch = int(graphs is not None)  # a block past the core's for the graphs' padding
        memory.check_kv_fits((num_blocks + scratch) * self.kv_bytes_per_block(block_size)
                             + self.state_bytes(), self.device)
        self._allocate_states()
        caches = self._caches(num_blocks + scratch, block_size)
        self.runner.kv_caches = caches[:len(stage_range(self.arch.num_layers))]
        if graphs is not None:
            graphs.bind(self.runner.kv_caches, scratch_block=num_blocks)
        if self.runner.drafter is not None:
            self.runner.drafter.kv_caches = caches[self.arch.num_layers:]
        return num_blocks

    def _caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        """A KV cache of `num_blocks` blocks for each KV layer (_kv_layers' order)."""
        rank_block = self._rank_block(block_size)
        return [spec.as_kv(memory.zeros(spec.shape(num_blocks, rank_block), self.kv_dtype,
                                        self.device)) for spec in self._kv_layers()]

    def _allocate_states(self) -> int:
        """The recurrent states of linear-attention layers, one per batch row (the request in
        it) and their slots: allocated beside the KV cache, out of its memory. Returns their
        bytes."""
        plan = self._state_plan()
        for layer, shape in plan:
            layer.allocate_state(shape[0], self.dtype, self.device, *shape[1:])
        if self.runner.drafter is not None:
            self.runner.drafter.resume_slots = self.config.state_checkpoint_slots
        total = self.state_bytes()
        if plan:
            logger.info("linear-attention states: %d layers x (%d requests + %d saved for "
                        "prefix caching), %.1f MiB of the KV cache memory", len(plan),
                        self.config.scheduler.max_num_seqs, self.config.state_checkpoint_slots,
                        total / 2**20)
        return total

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.do_idle_work()  # a busy engine packs a few weights before each step instead
        out = self.runner.execute(sched)
        if self.placement.dp_size > 1 and not sched.num_scheduled_tokens:
            # the empty step of a replica in lockstep: its experts serve the others' rows
            exchange_without_rows(self.routed_by, self.dtype, self.device)
        if self.routed_by:
            out.expert_tokens = tokens_per_rank(self.routed_by)
        return out

    def do_idle_work(self) -> bool:
        """Pack the next few dense weights (about 5 ms), or capture a CUDA graph that a step
        needed; whether any work is left."""
        if self.packing is not None and self.packing.pack_some():
            self.packing = None
        graphs = self.runner.graphs if self.runner is not None else None
        more_graphs = graphs is not None and graphs.capture_wanted()
        return self.packing is not None or more_graphs
