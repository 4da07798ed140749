"""Data-parallel replicas that step in lockstep, and the ports where ranks meet.

Where a mixture's experts span the replicas (expert parallelism with several replicas), every
MoE layer of every forward pass exchanges rows among all the replicas' ranks, so each replica
must run as many forward passes as the others: one per round, an empty one where it has nothing
to run. Before each round the engine cores agree, in one small all-reduce of their own (gloo,
outside the ranks' world: a core may host a rank or not), on whether any replica has work, any
received a message, or any is stopping.

Torch is imported where used: the front end takes `free_port` from here before it imports torch.
"""
from __future__ import annotations

import datetime
import os
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host`'s interface ("" for every interface), for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReplicaLockstep:
    """The cores' group: replica `rank` of `size`, meeting at host:port (replica 0 serves the
    rendezvous store). Cores on one machine agree through shared memory (tens of
    microseconds), others through gloo (a TCP round trip: 1.7-1.8 ms on the loopback here)."""

    def __init__(self, rank: int, size: int, host: str, port: int,
                 timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        self._group = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._shm = _shared_memory(store, self._group, rank, size, timeout_s)

    def agree(self, busy: bool, received: bool, stopping: bool) -> tuple[bool, bool, bool]:
        """Whether any replica (busy) has work, (received) took a message since the last round,
        (stopping) is shutting down. Every replica calls it once per round."""
        import torch

        flags = torch.tensor([busy, received, stopping], dtype=torch.int32)
        if self._shm is not None:
            self._shm.all_reduce(flags)
        else:
            self._group.allreduce([flags]).wait()  # a sum: nonzero where any replica said so
        any_busy, any_received, any_stopping = (bool(f) for f in flags.tolist())
        return any_busy, any_received, any_stopping

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None


def _shared_memory(store, group, rank: int, size: int, timeout_s: float):
    """The cores' shared-memory all-reduce where they all run on this machine (x86), else None.
    Every core calls it."""
    from octavo.distributed import shm_all_reduce as shm

    able = shm.supported() and os.path.isdir("/dev/shm")
    store.set(f"machine/{rank}", f"{shm.machine_id()}/{int(able)}")
    places = {store.get(f"machine/{r}").decode() for r in range(size)}
    if not able or len(places) > 1:
        return None
    if rank == 0:  # a name no stale file has
        path = f"/dev/shm/octavo-lockstep-{os.getpid()}-{os.urandom(7).hex()}"
        shm.ShmAllReduce.create_file(path, size, _FLAGS_BYTES)
        store.set("shm", path)
    path = store.get("shm").decode()
    try:
        return shm.ShmAllReduce(path, rank, size, _FLAGS_BYTES, timeout_s)
    finally:
        group.barrier().wait()  # every core has it mapped: the name can go
        if rank == 0:
            os.unlink(path)


_FLAGS_BYTES = 64  # a slot: the three flags, with room to spare
