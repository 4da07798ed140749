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
import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free now on `host`'s interface ("" for every interface), for a rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ReplicaLockstep:
    """The cores' group: replica `rank` of `size`, meeting at host:port (replica 0 serves the
    rendezvous store)."""

    def __init__(self, rank: int, size: int, host: str, port: int,
                 timeout_s: float = 600.0) -> None:
        import torch.distributed as dist

        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
        self._group = dist.ProcessGroupGloo(store, rank, size, timeout)
        self._options = dist.AllreduceOptions()
        self._options.reduceOp = dist.ReduceOp.MAX
        self.rank, self.size = rank, size

    def agree(self, busy: bool, received: bool, stopping: bool) -> tuple[bool, bool, bool]:
        """Whether any replica (busy) has work, (received) took a message since the last round,
        (stopping) is shutting down. Every replica calls it once per round."""
        import torch

        flags = torch.tensor([busy, received, stopping], dtype=torch.int32)
        self._group.allreduce([flags], self._options).wait()
        any_busy, any_received, any_stopping = (bool(f) for f in flags.tolist())
        return any_busy, any_received, any_stopping
