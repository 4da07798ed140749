"""Which CPU cores each local rank runs on, and its torch thread count.

Ranks on one machine that all use every core fight over them: each rank's OpenMP pool spins
threads on cores the other ranks are computing on, and a tensor-parallel step waits for the
slowest rank at every all-reduce. With cpu_binding `auto` each local rank is pinned to its own
share of the cores this process may run on (`os.sched_getaffinity`, so a container's or
`taskset`'s limit is respected) and runs that many threads.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def local_ranks(nodes: list[str]) -> list[tuple[int, int]]:
    """Each rank's (index among the ranks on its machine, ranks on that machine), from the
    machine each rank runs on: what decides its share of that machine's cores."""
    return [(nodes[:rank].count(node), nodes.count(node)) for rank, node in enumerate(nodes)]


def rank_cpus(local_rank: int, local_world_size: int, allowed: list[int]) -> list[int]:
    """`local_rank`'s share of `allowed`: consecutive cores, shares differing by at most one.
    With fewer cores than ranks, ranks share cores round-robin, one core each."""
    if local_world_size < 1 or not 0 <= local_rank < local_world_size:
        raise ValueError(f"local rank {local_rank} outside a local world of {local_world_size}")
    if not allowed:
        raise ValueError("no CPU to place a rank on")
    cpus = sorted(allowed)
    if len(cpus) < local_world_size:
        return [cpus[local_rank % len(cpus)]]
    base, extra = divmod(len(cpus), local_world_size)
    start = local_rank * base + min(local_rank, extra)
    return cpus[start:start + base + (local_rank < extra)]


def bind_rank_cpus(local_rank: int, local_world_size: int, cpu_binding: str,
                   num_threads: int | None = None) -> list[int] | None:
    """Pin this process to `local_rank`'s cores (cpu_binding `auto`, more than one local rank)
    and set torch's threads to `num_threads`, else to as many as the cores it got. Call it
    before torch runs anything in parallel (its thread pool takes the affinity it starts with).
    Returns the cores, or None where nothing was pinned (`none`, or a single local rank): the
    caller then sets the threads as for one process."""
    if cpu_binding not in ("auto", "none"):
        raise ValueError(f"cpu_binding must be auto or none, got {cpu_binding!r}")
    if cpu_binding == "none" or local_world_size == 1:
        return None
    cpus = rank_cpus(local_rank, local_world_size, list(os.sched_getaffinity(0)))
    os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(num_threads or len(cpus))
    logger.info("local rank %d of %d: cores %s, %d torch threads", local_rank, local_world_size,
                cpus, torch.get_num_threads())
    return cpus
