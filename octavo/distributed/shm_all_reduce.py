"""All-reduce (and all-gather) through shared memory for the CPU ranks of a group on one machine.

gloo's all-reduce goes through TCP on the loopback: a few hundred microseconds for a decode
step's hidden state, twice per layer. Ranks on one machine can instead share a mapping: each
writes its tensor into its own slot, raises its flag, spins until every rank's flag is up, and
sums the slots itself in rank order (so every rank gets the same bits). Two sets of slots
alternate between calls: a rank reuses a set only after every rank has raised its flag for the
call in between, which each does only once it has read the set. The flags' ordering relies on
x86's stores becoming visible in program order (the data before the flag), so `supported()`
is x86 only; elsewhere, and for tensors larger than the slots, the caller keeps gloo. An
all-gather is the same exchange, each rank copying the slots instead of summing them (the
context-parallel group's).
"""
from __future__ import annotations

import hashlib
import math
import mmap
import os
import platform
import time

import numpy as np
import torch

FLAG_STRIDE = 64  # bytes: each rank's flag on a cache line of its own
DEFAULT_CAPACITY = 4 << 20  # bytes per slot: a decode step's tensors, not big prefills
SPINS_PER_CHECK = 256  # flag reads between a yield and a look at the clock


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


class ShmAllReduce:
    """One group's all-reduce and all-gather over a shared file that every rank has mapped."""

    def __init__(self, path: str, rank: int, world_size: int, capacity: int = DEFAULT_CAPACITY,
                 timeout_s: float = 600.0) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside a group of {world_size}")
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        self.timeout_s = timeout_s
        header = FLAG_STRIDE * world_size
        size = header + 2 * world_size * capacity
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != size:
                raise ValueError(f"{path}: {os.fstat(fd).st_size} bytes, {size} expected")
            self._map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        # flags[r] is the last call rank r has written its slot for: [world_size] int64
        self._flags = np.frombuffer(self._map, np.int64, header // 8).reshape(
            world_size, FLAG_STRIDE // 8)[:, 0]
        data = torch.frombuffer(self._map, dtype=torch.uint8, offset=header)
        # [2 (alternating sets), world_size, capacity] bytes
        self._slots = data.view(2, world_size, capacity)
        self.calls = int(self._flags[rank])

    @staticmethod
    def create_file(path: str, world_size: int, capacity: int = DEFAULT_CAPACITY) -> None:
        """The zeroed shared file for a group (one rank creates it, the others then open it)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, FLAG_STRIDE * world_size + 2 * world_size * capacity)
        finally:
            os.close(fd)

    def fits(self, x: torch.Tensor) -> bool:
        return (x.device.type == "cpu" and x.is_contiguous()
                and x.numel() * x.element_size() <= self.capacity)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, in place (summed in rank order on every rank)."""
        parts = self._exchange(x)
        flat = x.view(-1)
        flat.copy_(parts[0])
        for part in parts[1:]:
            flat.add_(part)
        return x

    def all_gather(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` into `out` ([world_size, *x.shape]), in rank order."""
        for r, part in enumerate(self._exchange(x)):
            out[r].view(-1).copy_(part)
        return out

    def all_to_all(self, parts: list[torch.Tensor], send_counts: list[int]
                   ) -> tuple[list[torch.Tensor], list[int]]:
        """Rows to each rank: parts (the same number of rows each, dtypes of their own) hold
        send_counts[0] rows for rank 0, then send_counts[1] for rank 1...; returns the rows
        every rank sent this one, in rank order, and how many each sent. One exchange: a slot
        holds its rank's counts, then each part's rows (from an 8-byte boundary)."""
        counts = torch.tensor(send_counts, dtype=torch.int64)
        pieces = [counts.view(torch.uint8)]
        for p in parts:  # each part from an 8-byte boundary, so that any dtype views it
            data = p.contiguous().view(-1).view(torch.uint8)
            pieces += [data, data.new_zeros(-len(data) % 8)]
        payload = torch.cat(pieces)
        slots = self._exchange(payload, whole=True)
        header = 8 * self.world_size
        received = [[] for _ in parts]
        recv_counts = []
        for slot in slots:
            theirs = slot[:header].view(torch.int64).tolist()
            total, before, n = sum(theirs), sum(theirs[:self.rank]), theirs[self.rank]
            recv_counts.append(n)
            at = header
            for out, part in zip(received, parts):
                row = math.prod(part.shape[1:]) * part.element_size()
                start = at + before * row
                out.append(slot[start:start + n * row].view(part.dtype).view(
                    n, *part.shape[1:]))
                at += total * row + (-total * row) % 8
        return [torch.cat(r) for r in received], recv_counts  # copies: the slots are reused

    def _exchange(self, x: torch.Tensor, whole: bool = False) -> list[torch.Tensor]:
        """Publish `x` and wait for every rank's: their flat tensors of x's size and dtype (or
        their whole slots, as bytes: ranks that publish sizes of their own), read in place
        (valid until this rank's next call)."""
        nbytes = x.numel() * x.element_size()
        call = self.calls + 1
        slots = self._slots[call % 2]
        slots[self.rank, :nbytes].copy_(x.view(-1).view(torch.uint8))
        self._flags[self.rank] = call  # after the data: x86 keeps the two stores in order
        self._wait(call)
        self.calls = call
        if whole:
            return [slots[r] for r in range(self.world_size)]
        return [slots[r, :nbytes].view(x.dtype) for r in range(self.world_size)]

    def _wait(self, call: int) -> None:
        flags = self._flags
        deadline = None
        while True:
            for _ in range(SPINS_PER_CHECK):
                if flags.min() >= call:
                    return
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now > deadline:
                late = [r for r in range(self.world_size) if flags[r] < call]
                raise RuntimeError(f"shared-memory all-reduce: rank(s) {late} did not arrive "
                                   f"within {self.timeout_s:g} s")
            os.sched_yield()  # more spinners than cores must not starve the late rank

    def close(self) -> None:
        self._slots = self._flags = None
        self._map.close()


def machine_id() -> int:
    """The same number for every process on this machine (this boot), another elsewhere."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    digest = hashlib.sha256(f"{platform.node()}/{boot}".encode()).digest()
    return int.from_bytes(digest[:8], "little", signed=True)


def open_for_group(group, ranks: list[int], rank_in_group: int,
                   capacity: int = DEFAULT_CAPACITY,
                   timeout_s: float = 600.0) -> ShmAllReduce | None:
    """The group's shared-memory all-reduce, where every rank of `group` (global ranks `ranks`)
    is a CPU process on this machine and the CPU is x86; else None. Collective: every rank of
    the group calls it."""
    import torch.distributed as dist

    size = len(ranks)
    able = supported() and os.path.isdir("/dev/shm")
    ids = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(ids, torch.tensor([machine_id(), int(able)]), group=group)
    local = all(int(i[0]) == int(ids[0][0]) and int(i[1]) for i in ids)
    # A name no stale file has: the first rank's pid and a random number, sent to the others.
    token = torch.tensor([os.getpid(), int.from_bytes(os.urandom(7), "little")]
                         if rank_in_group == 0 else [0, 0], dtype=torch.int64)
    dist.broadcast(token, ranks[0], group=group)
    if not local:
        return None
    path = f"/dev/shm/octavo-all-reduce-{int(token[0])}-{int(token[1]):x}"
    if rank_in_group == 0:
        ShmAllReduce.create_file(path, size, capacity)
    dist.barrier(group=group)
    try:
        return ShmAllReduce(path, rank_in_group, size, capacity, timeout_s)
    finally:
        dist.barrier(group=group)  # every rank has it mapped: the name can go
        if rank_in_group == 0:
            os.unlink(path)
