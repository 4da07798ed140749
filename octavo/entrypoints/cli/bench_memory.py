"""Memory figures for the bench tables: resident memory of the engine's processes (this one and
its children, e.g. multiprocess workers) from /proc, and the bytes its model weights take.

VmHWM is the kernel's peak resident set of a process since it started, so it also counts what a
peer backend run in the same process (transformers, llama.cpp) allocated: compare peak memory per
mode with `--backends octavo` only. `weights_mb` is exact and counts packed weights (int4/int8)
as their bytes: it shows what --quantization saves, whatever the allocator keeps around.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module; torch loads only with an engine
    import torch


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text().split()
        out.extend(int(c) for c in text)
    return out + [g for c in out for g in _children(c)]


def process_memory() -> dict:
    """{"rss_mb", "peak_rss_mb"} of this process and its children; {} where /proc is missing."""
    if not Path("/proc/self/status").is_file():
        return {}
    pids = [os.getpid()]
    try:
        pids += _children(os.getpid())
    except OSError:  # a child that just exited
        pass
    rss = peak = 0
    for pid in pids:
        try:
            rss += _status_kb(pid, "VmRSS")
            peak += _status_kb(pid, "VmHWM")
        except OSError:
            continue
    return {"rss_mb": round(rss / 1024, 1), "peak_rss_mb": round(peak / 1024, 1)}


def weights_mb(llm) -> float | None:
    """Bytes of the model's parameters and packed weights (an in-process worker only)."""
    worker = getattr(llm.engine.client.core.executor, "worker", None) \
        if hasattr(llm.engine.client, "core") else None
    if getattr(worker, "runner", None) is None:
        return None
    model = worker.runner.model
    seen: set[int] = set()
    total = 0

    def add(t: torch.Tensor | None) -> None:
        nonlocal total
        if t is None:
            return
        if t.is_mkldnn:  # a oneDNN-packed weight: opaque, no storage to share
            key, nbytes = id(t), t.numel() * t.element_size()
        else:
            key, nbytes = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
        if key not in seen:
            seen.add(key)
            total += nbytes

    for p in model.parameters():
        add(p)
    for module in model.modules():  # linear layers' and the LM head's typed weights
        weights = getattr(module, "weights", None)
        if hasattr(weights, "tensors"):
            for t in weights.tensors().values():
                add(t)
    return round(total / 2 ** 20, 1)


def memory_report(llm) -> dict:
    return {**process_memory(), "weights_mb": weights_mb(llm)}


def memory_line(mem: dict) -> str:
    parts = [f"{name} {mem[key]:.0f} MB" for key, name in
             (("weights_mb", "weights"), ("rss_mb", "RSS"), ("peak_rss_mb", "peak RSS"))
             if mem.get(key) is not None]
    return "memory: " + ", ".join(parts) if parts else "memory: not measured here"
