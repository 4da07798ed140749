"""A worker's memory: what is available on its device, the KV cache's allocation, and on a GPU
the plan of what the KV cache may take.

`gpu_memory_utilization` (octavo's `kv_cache_memory_fraction`) means there what it means in
vLLM: the share of the GPU's whole memory that this engine may hold, weights, activations, CUDA
graphs and KV cache together (several engines can share a GPU by their shares). The KV cache
takes what is left of that share after
- what the engine held when the plan was made: the weights and the CUDA libraries' workspaces,
  all that the GPU's free memory fell by since the worker started;
- the activations of the largest step (a fresh prompt of `max_num_batched_tokens` tokens, the
  LM head over `max_num_seqs` rows): one such step is run into a small temporary KV cache and
  its peak measured (torch's allocator statistics);
- the CUDA graphs' memory pool: the largest decode bucket's step, run the same way (graphs are
  captured later, once steps need them, but their memory is planned now).
It never takes more than the GPU has free after those. The plan is printed (rank 0).
"""
from __future__ import annotations

import math
import mmap
from collections.abc import Callable
from dataclasses import dataclass

import torch


def available_memory(device: torch.device) -> tuple[int, str] | None:
    """Bytes the KV cache could still take on `device`, and where that figure comes from; None
    where the system does not say."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], "free on the GPU"
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):  # "MemAvailable:   12345678 kB"
                    return int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_kv_fits(kv_cache_memory: int, device: torch.device) -> None:
    """Refuse a KV cache larger than the memory left, before anything is allocated: on the CPU
    the cache is mapped lazily (zeros), so a 10 TB one would not fail here but be OOM-killed
    once written, and the core's block pool for it alone takes minutes and gigabytes. The check
    runs after the weights are loaded, so the figure is already net of them; it allows up to
    all of it (an allocation close to free memory is legitimate, and page cache counts as
    available because the OS reclaims it). A cgroup limit below MemAvailable is not seen."""
    free = available_memory(device)
    if free is None or kv_cache_memory <= free[0]:
        return
    raise ValueError(
        f"kv_cache_memory: {_gib(kv_cache_memory)} asked for the KV cache, but only "
        f"{_gib(free[0])} is available ({free[1]}, after loading the weights); lower "
        f"--kv-cache-memory (kv_cache_memory= in Python)")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):,.2f} GiB ({n} bytes)"


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros; on the CPU an anonymous mapping, whose zero pages the OS maps lazily, so a large KV
    cache costs no start-up time and no resident memory until it is written (torch.zeros
    memsets). Not numpy's calloc: numpy marks allocations of 4 MB and more for transparent huge
    pages, so each first write into a 2 MB stretch of the cache zeroed 2 MB, compacting memory
    first when none was free. A first one-token request wrote 30 of them, one per layer: 25-270
    ms instead of about 12, most of it in the kernel."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or not nbytes:  # (an empty mapping is refused)
        return torch.zeros(shape, dtype=dtype, device=device)
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8).view(dtype).view(shape)


def peak_of(device: torch.device, step: Callable[[], object]) -> int:
    """Bytes `step` allocates on the GPU at its peak, beyond what was allocated before it."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return max(peak, 0)


@dataclass(frozen=True)
class GpuPlan:
    total: int  # the GPU's memory
    fraction: float  # of it, this engine's share
    held: int  # what the engine holds (weights, libraries' workspaces)
    activations: int  # the largest step's peak
    graphs: int  # the largest decode graph's
    free: int  # what the GPU has free now

    @property
    def kv_cache(self) -> int:
        """What the KV cache may take (0 where nothing is left)."""
        reserved = self.activations + self.graphs
        return max(0, min(int(self.fraction * self.total) - self.held, self.free) - reserved)

    def describe(self, device: torch.device, step_tokens: int) -> str:
        gib = 1 << 30
        return (f"memory plan on {device} ({self.total / gib:.2f} GiB; gpu_memory_utilization "
                f"{self.fraction:.2f}: {self.fraction * self.total / gib:.2f} GiB for this "
                f"engine): weights and libraries {self.held / gib:.2f} GiB, "
                f"activations {self.activations / gib:.2f} GiB (a {step_tokens}-token step, "
                f"profiled), CUDA graphs {self.graphs / gib:.2f} GiB (the largest decode "
                f"bucket, profiled), KV cache up to {self.kv_cache / gib:.2f} GiB; "
                f"{(self.free - self.activations - self.graphs - self.kv_cache) / gib:.2f} GiB "
                f"of the GPU left free")


def plan(device: torch.device, fraction: float, free_at_start: int, activations: int,
         graphs: int) -> GpuPlan:
    """The plan, from the profiled peaks (peak_of), once what the profiles allocated is freed."""
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return GpuPlan(total, fraction, max(0, free_at_start - free), activations, graphs, free)
