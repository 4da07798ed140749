"""Engine configuration: small frozen dataclasses, one per component.

Each component receives only its own part. Command-line flags are derived from these fields
(`add_engine_args` / `EngineConfig.from_cli`), so a flag exists exactly once: here.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field, fields
from typing import Any

from octavo.pooling_params import PoolerConfig

DEFAULT_MODEL = "smollm2-135m-instruct"


def _opt(help: str, **extra: Any) -> Any:
    return {"help": help, **extra}


TASKS = ("auto", "generate", "embed", "classify", "score", "reward")


@dataclass(frozen=True)
class ModelConfig:
    model: str = field(default=DEFAULT_MODEL, metadata=_opt(
        "model: a catalog name, a local Hugging Face folder, a .gguf file or a hub id"))
    dtype: str = field(default="auto", metadata=_opt(
        "weights and activations dtype", choices=["auto", "float32", "bfloat16"]))
    max_model_len: int | None = field(default=None, metadata=_opt(
        "context length (prompt + output); default: the model's own"))
    tokenizer: str | None = field(default=None, metadata=_opt(
        "tokenizer folder, if not the model's own"))
    revision: str | None = field(default=None, metadata=_opt("hub revision for a hub id"))
    decode_weights: str = field(default="auto", metadata=_opt(
        "auto: linear layers from 2- to 8-bit GGUF tensors keep an int4/int8 copy, made from "
        "the GGUF's codes, for small batches (bf16 on the CPU); none: dense weights only",
        choices=["auto", "none"]))
    dense_prefill_weights: bool = field(default=False, metadata=_opt(
        "a GGUF keeps a dense copy of its weights for prefill beside its int4/int8 codes "
        "(weights 2.7-6x the file); default: prefill too computes from the codes, the weights "
        "about the file's size"))
    quantization: str | None = field(default=None, metadata=_opt(
        "quantize an unquantized safetensors checkpoint at load: int8 (per channel), int4 (per "
        "group of 32), fp8 (e4m3 per channel, computed in bf16); on a GGUF, int4/int8 keep only "
        "its codes in that layout, no dense weights; default: what the checkpoint has",
        choices=["int8", "int4", "fp8"]))
    task: str = field(default="auto", metadata=_opt(
        "what the model serves: generate (text; a causal LM also pools embeddings beside it); "
        "or only pooling, its requests by default: embed (embeddings: LLM.embed, "
        "/v1/embeddings), classify (a classifier's probabilities), score (a cross-encoder's), "
        "reward (a decoder head's values per token or step tag); auto: generate for a model "
        "with an LM head, embed for the others (encoders, classifiers)",
        choices=list(TASKS)))
    pooler_config: str | None = field(default=None, metadata=_opt(
        "pooling defaults as JSON, over the model folder's: {\"pooling_type\": MEAN|CLS|LAST "
        "(task embed's) or ALL|STEP (task reward's positions), \"normalize\": bool, "
        "\"step_tag_id\": int, \"returned_token_ids\": [int, ...]}"))
    model_impl: str = field(default="auto", metadata=_opt(
        "the model's code: octavo (its native file), transformers (transformers' modeling code "
        "with octavo's paged attention, for any decoder-only *ForCausalLM), auto (native where "
        "octavo has a file, else transformers)", choices=["auto", "octavo", "transformers"]))

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if isinstance(self.pooler_config, dict):  # offline: LLM(..., pooler_config={...})
            object.__setattr__(self, "pooler_config", json.dumps(self.pooler_config))
        PoolerConfig.parse(self.pooler_config)  # a bad one fails here, naming its key
        if self.model_impl not in ("auto", "octavo", "transformers"):
            raise ValueError(f"model_impl must be auto, octavo or transformers, got "
                             f"{self.model_impl!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, got {self.dtype!r}")
        if self.decode_weights not in ("auto", "none"):
            raise ValueError(f"decode_weights must be auto or none, got {self.decode_weights!r}")
        if not isinstance(self.dense_prefill_weights, bool):
            raise ValueError(f"dense_prefill_weights must be a bool, "
                             f"got {self.dense_prefill_weights!r}")
        if self.quantization not in (None, "int8", "int4", "fp8"):
            raise ValueError(f"quantization must be int8, int4 or fp8 (or unset), "
                             f"got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = field(default=16, metadata=_opt("tokens per KV-cache block"))
    kv_cache_memory: int | None = field(default=None, metadata=_opt(
        "bytes of memory for the KV cache (all layers), allocated once at start-up; default: "
        "on the CPU enough for one request of the full context (at least 1 GiB), within "
        "--kv-cache-memory-fraction of the memory left after the weights; on a GPU all that "
        "the fraction leaves (the context is cut to fit, with a warning, where that is too "
        "small)"))
    kv_cache_memory_fraction: float | None = field(default=None, metadata=_opt(
        "with no --kv-cache-memory: on the CPU the largest share of the memory available after "
        "the weights that the KV cache takes (default 0.5); on a GPU, as vLLM's "
        "--gpu-memory-utilization, the share of the GPU's whole memory this engine holds, "
        "weights, activations, CUDA graphs and KV cache together (default 0.9)",
        aliases=("--gpu-memory-utilization",)))
    enable_prefix_caching: bool = field(default=True, metadata=_opt(
        "reuse the KV blocks of prompt prefixes computed before"))
    kv_cache_dtype: str = field(default="auto", metadata=_opt(
        "KV cache element type: auto (the model dtype), bfloat16, fp8_e4m3 or fp8, vLLM's name "
        "for it (half of bf16's memory; per-layer scales from the checkpoint's "
        "k_scale/v_scale, else 1)",
        choices=["auto", "bfloat16", "fp8_e4m3", "fp8"]))
    mamba_block_size: int | None = field(default=None, metadata=_opt(
        "models with linear-attention layers (Qwen3-Next), with prefix caching: every this many "
        "tokens (a multiple of --block-size) a request's recurrent states are saved, keyed by "
        "the prefix's block hash, so that a later request with that prefix resumes from them "
        "(vLLM's name); default: 256, or --block-size where larger"))
    state_checkpoints: int | None = field(default=None, metadata=_opt(
        "models with linear-attention layers, with prefix caching: how many saved states are "
        "kept (the least recently used is replaced), out of the KV cache's memory; default: "
        "--max-num-seqs"))

    def __post_init__(self) -> None:
        if self.kv_cache_dtype == "fp8":  # vLLM's name for e4m3 on every platform but ROCm's
            object.__setattr__(self, "kv_cache_dtype", "fp8_e4m3")
        if self.kv_cache_dtype not in ("auto", "bfloat16", "fp8_e4m3"):
            raise ValueError(f"kv_cache_dtype must be auto, bfloat16, fp8_e4m3 or fp8, "
                             f"got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be >= 1, got {self.kv_cache_memory}")
        if self.mamba_block_size is not None and (self.mamba_block_size < 1
                                                  or self.mamba_block_size % self.block_size):
            raise ValueError(f"mamba_block_size must be a positive multiple of block_size "
                             f"({self.block_size}), got {self.mamba_block_size}")
        if self.state_checkpoints is not None and self.state_checkpoints < 0:
            raise ValueError(f"state_checkpoints must be >= 0, got {self.state_checkpoints}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not 0 < fraction <= 1:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 1], "
                             f"got {self.kv_cache_memory_fraction!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = field(default=64, metadata=_opt("most requests running in one step"))
    max_num_batched_tokens: int = field(default=2048, metadata=_opt(
        "token budget of one step; longer prompts are prefilled in chunks"))
    scheduling_policy: str = field(default="fcfs", metadata=_opt(
        "fcfs: requests are served in arrival order, their priority ignored; priority: lower "
        "priority values first, and a waiting request short of KV blocks or of a seat preempts "
        "running requests of strictly lower priority", choices=["fcfs", "priority"]))
    priority_aging_steps: int = field(default=1000, metadata=_opt(
        "with --scheduling-policy priority: a request's priority improves by 1 for every this "
        "many steps since it arrived, so none starves; 0: no aging"))
    grammar_compile_timeout: float = field(default=60.0, metadata=_opt(
        "seconds a structured-output grammar may take to compile (from its submission) before "
        "the request waiting on it is aborted"))

    def __post_init__(self) -> None:
        if not self.grammar_compile_timeout > 0:
            raise ValueError(f"grammar_compile_timeout must be > 0 seconds, "
                             f"got {self.grammar_compile_timeout!r}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, "
                             f"got {self.scheduling_policy!r}")
        if self.priority_aging_steps < 0:
            raise ValueError(
                f"priority_aging_steps must be >= 0, got {self.priority_aging_steps}")


# --attention-backend's names (vLLM's): kernels/attention_backend.py; the others vLLM has are
# refused by name
ATTENTION_BACKENDS = ("CPU_ATTN", "TORCH_SDPA")
ATTENTION_BACKENDS_NOT_BUILT = ("FLASH_ATTN", "FLASHINFER", "FLEX_ATTENTION", "TRITON_ATTN")


@dataclass(frozen=True)
class DeviceConfig:
    device: str = field(default="cpu", metadata=_opt("device to run on", choices=["cpu", "cuda"]))
    num_threads: int | None = field(default=None, metadata=_opt(
        "torch threads for the engine; default: all cores"))
    seed: int = field(default=0, metadata=_opt("seed of requests that set none"))
    native_kernels: str = field(default="on", metadata=_opt(
        "octavo's C++ CPU kernels: on (built at the first start, about 30 s, then cached), "
        "background (serve with PyTorch ops until the build is done), off",
        choices=["on", "background", "off"]))
    enforce_eager: bool = field(default=False, metadata=_opt(
        "run every step layer by layer from Python; by default a decode step runs its whole "
        "decoder stack in one C++ call on the CPU, and replays a captured CUDA graph on a GPU"))
    attention_backend: str = field(default="auto", metadata=_opt(
        "attention over the paged KV cache (vLLM's names, any case): CPU_ATTN (octavo's C++ "
        "kernel; auto on the CPU), TORCH_SDPA (torch ops over keys gathered through the block "
        "tables; auto on a GPU)"))
    cudagraph_capture_sizes: tuple[int, ...] | None = field(default=None, metadata=_opt(
        "on a GPU, the batch sizes whose decode steps are captured as CUDA graphs (a step is "
        "padded to the next; larger ones run eagerly), each captured when a step first needs it; "
        "default: 1 2 4 8 16 ... 512 up to --max-num-seqs", nargs="+", metavar="N",
        aliases=("--cuda-graph-sizes",)))
    compilation_level: int = field(default=0, metadata=_opt(
        "run the decoder layers' Python steps (prefill, mixed steps, every step under "
        "--enforce-eager) as compiled graphs (torch.export + AOTInductor, one per kind of layer, "
        "made once and loaded from disk at later starts): 1-3 (alike), 0 runs them eagerly; "
        "vLLM's -O / compilation_config", choices=[0, 1, 2, 3], aliases=("-O",)))

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")
        if self.compilation_level not in (0, 1, 2, 3) or isinstance(self.compilation_level, bool):
            raise ValueError(f"compilation_level must be 0, 1, 2 or 3, got "
                             f"{self.compilation_level!r}")
        backend = str(self.attention_backend).upper()
        if backend in ATTENTION_BACKENDS_NOT_BUILT:
            raise NotImplementedError(f"attention_backend {self.attention_backend}: octavo has "
                                      f"no such backend yet (it has "
                                      f"{', '.join(ATTENTION_BACKENDS)})")
        if backend != "AUTO" and backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be auto or one of "
                             f"{', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}")
        if backend == "CPU_ATTN" and self.device != "cpu":
            raise ValueError(f"attention_backend CPU_ATTN runs on the CPU, not on {self.device}")
        object.__setattr__(self, "attention_backend", backend)
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            if (isinstance(sizes, (str, bytes)) or not sizes
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1
                               for n in sizes)):
                raise ValueError(f"cudagraph_capture_sizes must be batch sizes >= 1, "
                                 f"got {sizes!r}")
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(sorted(set(sizes))))
        if self.native_kernels not in ("on", "background", "off"):
            raise ValueError(f"native_kernels must be on, background or off, "
                             f"got {self.native_kernels!r}")


@dataclass(frozen=True)
class LoRAConfig:
    enable_lora: bool = field(default=False, metadata=_opt(
        "serve LoRA adapters beside the base model (requests name theirs: lora_request, or "
        "the OpenAI model field)"))
    max_loras: int = field(default=1, metadata=_opt(
        "adapters resident at once, in preallocated slots: a step runs requests of at most "
        "this many adapters, the others wait"))
    max_lora_rank: int = field(default=16, metadata=_opt(
        "highest adapter rank accepted (the slots are this wide)"))
    max_cpu_loras: int | None = field(default=None, metadata=_opt(
        "adapters kept loaded in host memory (least recently used dropped first); "
        "default: max_loras"))

    def __post_init__(self) -> None:
        if not isinstance(self.enable_lora, bool):
            raise ValueError(f"enable_lora must be true or false, got {self.enable_lora!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (isinstance(cpu, bool) or not isinstance(cpu, int)
                                or cpu < self.max_loras):
            raise ValueError(f"max_cpu_loras must be an integer >= max_loras "
                             f"({self.max_loras}), got {cpu!r}")

    @property
    def cpu_slots(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


EXECUTOR_BACKENDS = ("uniproc", "mp", "ray")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = field(default=1, metadata=_opt(
        "ranks that split every layer (attention heads, MLP columns and rows, the vocabulary)",
        aliases=("-tp",)))
    pipeline_parallel_size: int = field(default=1, metadata=_opt(
        "ranks that each run a contiguous range of the layers", aliases=("-pp",)))
    distributed_executor_backend: str | None = field(default=None, metadata=_opt(
        "how the ranks run: uniproc (in this process; one rank only), mp (one local process "
        "per rank), ray (Ray actors); default: uniproc for one rank, else mp",
        choices=list(EXECUTOR_BACKENDS)))
    cpu_binding: str = field(default="auto", metadata=_opt(
        "with several ranks on the CPU: auto gives each local rank an equal share of this "
        "process's allowed cores (and as many torch threads); none leaves every rank all of "
        "them", choices=["auto", "none"]))
    data_parallel_size: int = field(default=1, metadata=_opt(
        "replicas of the model, each its own engine core process (itself tensor/pipeline "
        "parallel as set) behind one server or offline LLM: requests go to the least loaded, or "
        "to the one whose prefix cache holds their leading tokens", aliases=("-dp",)))
    enable_expert_parallel: bool = field(default=False, metadata=_opt(
        "a mixture's experts partitioned over the tensor- and context-parallel ranks of every "
        "data-parallel replica, each rank holding whole experts (num_experts / (tp x cp x dp) "
        "of them), instead of a share of every expert; context-parallel ranks and replicas send "
        "rows to their experts' ranks and back (all-to-all), the replicas stepping in lockstep"))
    data_parallel_backend: str = field(default="mp", metadata=_opt(
        "where data-parallel replicas run: mp (local processes) or ray (Ray actors, spread "
        "over the machines of a Ray cluster)", choices=["mp", "ray"]))
    prefill_context_parallel_size: int = field(default=1, metadata=_opt(
        "context-parallel ranks that split the tokens of each step with a prompt chunk along "
        "the sequence (a share per rank, their keys and values exchanged for attention; a step "
        "of decodes runs whole on each); a dimension of its own: the world is tp x cp x pp "
        "ranks", aliases=("-pcp",)))
    decode_context_parallel_size: int = field(default=1, metadata=_opt(
        "context-parallel ranks that each keep a share of every request's KV blocks along the "
        "sequence (block j on rank j mod size); each rank attends over its share and the "
        "partial outputs are combined by their log-sum-exp. With "
        "--prefill-context-parallel-size too, the two must be equal (one group of ranks)",
        aliases=("-dcp",)))
    # Set by the launchers for each data-parallel replica, not options: its index, and where the
    # replicas meet when the experts span them (the ranks' world; the cores' lockstep group).
    data_parallel_rank: int = 0
    data_parallel_master_ip: str = "127.0.0.1"
    data_parallel_master_port: int = 0
    data_parallel_rpc_port: int = 0

    def __post_init__(self) -> None:
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be mp or ray, got "
                             f"{self.data_parallel_backend!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size",
                     "prefill_context_parallel_size", "decode_context_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        backend = self.distributed_executor_backend
        if backend is not None and backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend must be one of "
                             f"{', '.join(EXECUTOR_BACKENDS)} (or unset), got {backend!r}")
        if backend == "uniproc" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend uniproc runs one rank in process; "
                             f"tensor_parallel_size x context parallel x pipeline_parallel_size "
                             f"is {self.world_size}: use mp or ray")
        pcp, dcp = self.prefill_context_parallel_size, self.decode_context_parallel_size
        if pcp > 1 and dcp > 1 and pcp != dcp:
            raise ValueError(f"prefill_context_parallel_size ({pcp}) and "
                             f"decode_context_parallel_size ({dcp}) share one group of ranks: "
                             f"give them equal, or one of them 1")
        if not isinstance(self.enable_expert_parallel, bool):
            raise ValueError(f"enable_expert_parallel must be true or false, got "
                             f"{self.enable_expert_parallel!r}")
        if self.cpu_binding not in ("auto", "none"):
            raise ValueError(f"cpu_binding must be auto or none, got {self.cpu_binding!r}")
        if self.experts_span_replicas and self.pipeline_parallel_size > 1:
            raise NotImplementedError(
                "expert parallelism across data-parallel replicas with pipeline parallelism: "
                "the replicas' stages would have to run their batches in lockstep; use "
                "tensor or context parallelism within a replica")

    @property
    def experts_span_replicas(self) -> bool:
        """Expert parallelism with several replicas: a mixture's experts are partitioned over
        every replica's ranks, which then form one world and step in lockstep."""
        return self.enable_expert_parallel and self.data_parallel_size > 1

    @property
    def replica_init_method(self) -> str | None:
        """Where the joined replicas' ranks meet (torch.distributed), else None."""
        if not self.experts_span_replicas:
            return None
        return f"tcp://{self.data_parallel_master_ip}:{self.data_parallel_master_port}"

    @property
    def context_parallel_size(self) -> int:
        """The ranks of a context-parallel group (one for no context parallelism)."""
        return max(self.prefill_context_parallel_size, self.decode_context_parallel_size)

    @property
    def world_size(self) -> int:
        return (self.tensor_parallel_size * self.context_parallel_size
                * self.pipeline_parallel_size)

    @property
    def layout(self) -> str:
        """The ranks' layout as logs show it: "tp 2, pp 1" (and the context-parallel group's
        size when there is one)."""
        cp = self.context_parallel_size
        return (f"tp {self.tensor_parallel_size}, " + (f"cp {cp}, " if cp > 1 else "")
                + f"pp {self.pipeline_parallel_size}")

    @property
    def output_rank(self) -> int:
        """The rank that samples and answers a step: the last stage's first rank (rank =
        (pp_rank * cp_size + cp_rank) * tp_size + tp_rank)."""
        return (self.pipeline_parallel_size - 1) * self.context_parallel_size * \
            self.tensor_parallel_size

    @property
    def executor_backend(self) -> str:
        """The backend that runs: the one given, else uniproc for one rank and mp for more."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uniproc" if self.world_size == 1 else "mp"


_EAGLE_METHODS = ("eagle", "eagle3", "medusa", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding, given on the command line as one JSON object
    (`--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'`, or
    `'{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}'`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4  # longest n-gram matched against the earlier tokens
    prompt_lookup_min: int = 2  # shortest
    model: str | None = None  # the draft model (method draft_model): same tokenizer as the target

    def __post_init__(self) -> None:
        if self.method in _EAGLE_METHODS:
            raise ValueError(
                f"speculative_config.method {self.method!r}: EAGLE-style heads (eagle, eagle3, "
                f"medusa, mtp) are out of scope until real EAGLE weights exist for octavo's "
                f"models; use method 'ngram' or 'draft_model'")
        if self.method not in ("ngram", "draft_model"):
            raise ValueError(f"speculative_config.method must be 'ngram' or 'draft_model', "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in [1, 32], "
                             f"got {self.num_speculative_tokens}")
        if self.prompt_lookup_min < 1:
            raise ValueError(f"speculative_config.prompt_lookup_min must be >= 1, "
                             f"got {self.prompt_lookup_min}")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ValueError(f"speculative_config.prompt_lookup_max must be >= prompt_lookup_min "
                             f"({self.prompt_lookup_min}), got {self.prompt_lookup_max}")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config.model is required for method 'draft_model' "
                             "(a model with the target's tokenizer)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError("speculative_config.model is only for method 'draft_model'")

    @classmethod
    def parse(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        """From a SpeculativeConfig, a dict or a JSON object string; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config must be a JSON object: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown field(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        for name, v in value.items():
            want = str if name in ("method", "model") else int
            if v is not None and (not isinstance(v, want) or isinstance(v, bool)):
                raise ValueError(f"speculative_config.{name} must be a {want.__name__}, got {v!r}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding

    def __post_init__(self) -> None:
        if self.parallel.context_parallel_size > 1:
            if self.lora.enable_lora:
                raise NotImplementedError("context parallelism with enable_lora: the adapters' "
                                          "per-token slots are not split over the ranks yet")
            if self.speculative is not None and self.speculative.method == "draft_model":
                raise NotImplementedError("context parallelism with a draft model "
                                          "(speculative_config.model): the draft's KV cache is "
                                          "not split over the ranks yet; method ngram works")
        if self.parallel.experts_span_replicas:
            if self.lora.enable_lora:
                raise NotImplementedError("expert parallelism across data-parallel replicas "
                                          "with enable_lora: a dispatched row's adapter does "
                                          "not travel with it yet")
            if self.speculative is not None and self.speculative.method == "draft_model":
                raise NotImplementedError("expert parallelism across data-parallel replicas "
                                          "with a draft model (speculative_config.model): the "
                                          "replicas step in lockstep one forward pass at a "
                                          "time; method ngram works")

    @property
    def state_checkpoint_interval(self) -> int:
        """Tokens between a request's saved recurrent states (--mamba-block-size): whole core
        blocks, so that a block hash names each."""
        size = self.cache.mamba_block_size
        if size is None:
            return max(256, self.core_block_size)
        if size % self.core_block_size:
            raise ValueError(f"mamba_block_size ({size}) must be a multiple of the core's block "
                             f"({self.core_block_size} tokens)")
        return size

    @property
    def state_checkpoint_slots(self) -> int:
        """Saved recurrent states kept for prefix caching (used by models with linear-attention
        layers alone): --state-checkpoints, default --max-num-seqs; none without caching."""
        if not self.cache.enable_prefix_caching:
            return 0
        count = self.cache.state_checkpoints
        return self.scheduler.max_num_seqs if count is None else count

    @property
    def kv_memory_fraction(self) -> float:
        """kv_cache_memory_fraction, or its default on this device."""
        given = self.cache.kv_cache_memory_fraction
        return given if given is not None else 0.9 if self.device.device == "cuda" else 0.5

    @property
    def core_block_size(self) -> int:
        """Tokens per KV block as the core counts them: under decode context parallelism one
        core block is a block on each rank of the group (its j-th block_size tokens on rank
        j mod size), so every rank holds block_size of them."""
        return self.cache.block_size * self.parallel.decode_context_parallel_size

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat keyword arguments (`max_num_seqs=8`), each routed to its section;
        `speculative_config` is a SpeculativeConfig, a dict or a JSON string."""
        unknown = set(kwargs) - {"speculative_config"}
        parts: dict[str, Any] = {
            "speculative": SpeculativeConfig.parse(kwargs.get("speculative_config"))}
        for name, section in _SECTIONS.items():
            sub = {f.name: kwargs[f.name] for f in fields(section) if f.name in kwargs}
            unknown -= set(sub)
            parts[name] = section(**sub)
        if unknown:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(unknown))}")
        return cls(**parts)

    @classmethod
    def from_cli(cls, args: argparse.Namespace) -> EngineConfig:
        flat = {f.name: getattr(args, f.name) for sec in _SECTIONS.values() for f in fields(sec)
                if hasattr(args, f.name)}
        return cls.from_kwargs(speculative_config=getattr(args, "speculative_config", None),
                               **flat)

    def replace(self, **kwargs: Any) -> EngineConfig:
        flat = {f.name: getattr(getattr(self, s), f.name)
                for s, sec in _SECTIONS.items() for f in fields(sec)}
        flat["speculative_config"] = self.speculative
        flat.update(kwargs)
        return EngineConfig.from_kwargs(**flat)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
    "device": DeviceConfig, "parallel": ParallelConfig, "lora": LoRAConfig}


def _parse_bytes(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


def add_engine_args(parser: argparse.ArgumentParser, *, skip: tuple[str, ...] = ()) -> None:
    """Add one `--flag` per engine config field to `parser`."""
    for section in _SECTIONS.values():
        group = parser.add_argument_group(section.__name__)
        for f in fields(section):
            if f.name in skip or "help" not in f.metadata:  # set by octavo, not an option
                continue
            meta = dict(f.metadata)
            flags = ("--" + f.name.replace("_", "-"), *meta.pop("aliases", ()))
            default = f.default
            if f.name == "kv_cache_memory":
                group.add_argument(*flags, type=_parse_bytes, default=default,
                                   help=meta["help"] + " (e.g. 2GiB)")
            elif isinstance(default, bool):
                group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default,
                                   help=meta["help"])
            else:
                kind = {"int": int, "int | None": int, "float": float, "float | None": float,
                        "tuple[int, ...] | None": int}.get(f.type, str)
                group.add_argument(*flags, type=kind, default=default, **meta)
    if "speculative_config" not in skip:
        parser.add_argument_group("SpeculativeConfig").add_argument(
            "--speculative-config", default=None,
            help='speculative decoding as JSON, e.g. {"method": "ngram", '
                 '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2} '
                 'or {"method": "draft_model", "model": PATH, "num_speculative_tokens": 4}')
