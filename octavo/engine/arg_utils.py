"""vLLM's engine arguments (`from octavo.engine.arg_utils import EngineArgs, AsyncEngineArgs`,
as from vllm.engine.arg_utils): keyword options turned into an EngineConfig. octavo's own option
names pass through; vLLM's names for the same things are translated; vLLM options octavo cannot
honour yet are refused by name, never ignored."""
from __future__ import annotations

import json
from typing import Any

from octavo.config import DEFAULT_MODEL, EngineConfig

# vLLM's name -> octavo's. gpu_memory_utilization: on a GPU the share of its memory the engine
# holds, as in vLLM; on the CPU the share of the memory left after the weights the KV cache takes.
_RENAMED = {"gpu_memory_utilization": "kv_cache_memory_fraction",
            "cuda_graph_sizes": "cudagraph_capture_sizes"}
# vLLM options accepted only at the value that means "as octavo does anyway".
# (tensor_parallel_size, pipeline_parallel_size, data_parallel_size, enable_expert_parallel,
# the two context-parallel sizes and distributed_executor_backend are octavo's own names too:
# they pass through to ParallelConfig.)
_ONLY = {"trust_remote_code": False}
_WHY = {"trust_remote_code": "octavo never runs code shipped with a model"}
_NO_EFFECT = ("disable_log_stats",)  # logging choices with nothing to change here


def engine_config(model: str = DEFAULT_MODEL, **options: Any) -> EngineConfig:
    """The EngineConfig of `LLM(model, **options)` / `EngineArgs(model, **options)`."""
    translated: dict[str, Any] = {}
    for name, value in options.items():
        if name in _ONLY:
            if value != _ONLY[name]:
                raise NotImplementedError(f"{name}={value!r}: {_WHY[name]}")
            continue
        if name in _NO_EFFECT:
            continue
        if name == "compilation_config":
            translated.update(compilation_settings(value))
            continue
        translated[_RENAMED.get(name, name)] = value
    return EngineConfig.from_kwargs(model=model, **translated)


def compilation_settings(config: Any) -> dict[str, Any]:
    """vLLM's `compilation_config` (a level, a dict or its JSON, or an object with `level` or
    `mode`) as octavo's compilation_level and cudagraph_capture_sizes; its other settings are
    refused by name."""
    if isinstance(config, str):
        config = json.loads(config) if config.strip().startswith("{") else int(config)
    if isinstance(config, int) and not isinstance(config, bool):
        return {"compilation_level": config}
    if not isinstance(config, dict):
        config = {k: v for k, v in vars(config).items() if v is not None}
    settings = dict(config)
    level = settings.pop("mode", settings.pop("level", 0))
    out = {"compilation_level": int(level.value if hasattr(level, "value") else level)}
    if "cudagraph_capture_sizes" in settings:
        out["cudagraph_capture_sizes"] = settings.pop("cudagraph_capture_sizes")
    if settings.get("backend") in ("inductor", ""):
        settings.pop("backend")
    if settings:
        raise NotImplementedError(
            f"compilation_config: {', '.join(sorted(settings))} not supported (octavo takes "
            "its level or mode (AOTInductor graphs of the decoder layers) and "
            "cudagraph_capture_sizes)")
    return out


class EngineArgs:
    def __init__(self, model: str = DEFAULT_MODEL, **options: Any) -> None:
        self.model = model
        self.options = options
        self.create_engine_config()  # a bad option fails here, as vLLM's do

    def create_engine_config(self) -> EngineConfig:
        return engine_config(self.model, **self.options)


class AsyncEngineArgs(EngineArgs):
    pass
