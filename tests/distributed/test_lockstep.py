"""The data-parallel cores' lockstep group (distributed/lockstep.py), in three processes as the
cores are: every core learns whether any replica is busy, took a message or is stopping,
through shared memory on one machine and through gloo otherwise."""
from __future__ import annotations

import multiprocessing

import pytest

from octavo.distributed import lockstep

# each core's three rounds: (busy, received, stopping)
SAID = [[(False, True, False), (True, False, False), (False, False, False)],
        [(False, False, False), (False, False, True), (False, False, False)],
        [(False, False, False), (False, False, False), (False, False, False)]]
HEARD = [(False, True, False), (True, False, True), (False, False, False)]


def _core(rank: int, port: int, shared_memory: bool, results) -> None:
    from octavo.distributed import shm_all_reduce

    if not shared_memory:  # as cores on different machines meet
        shm_all_reduce.supported = lambda: False
    group = lockstep.ReplicaLockstep(rank, 3, "127.0.0.1", port, timeout_s=60)
    results.put((rank, group._shm is not None, [group.agree(*flags) for flags in SAID[rank]]))
    group.close()


@pytest.mark.parametrize("shared_memory", [True, False])
def test_replicas_agree_on_any_busy_received_or_stopping(shared_memory):
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    port = lockstep.free_port()
    procs = [mp.Process(target=_core, args=(r, port, shared_memory, results)) for r in range(3)]
    for p in procs:
        p.start()
    got = sorted(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(r, shared_memory, HEARD) for r in range(3)]
