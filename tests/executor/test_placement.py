"""Per-rank CPU binding: each local rank gets its own consecutive share of the allowed cores
(shares differ by at most one) and as many torch threads."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from octavo.distributed.placement import bind_rank_cpus, rank_cpus


def test_shares_cover_the_cores_once_and_evenly():
    for n in range(1, 10):
        allowed = list(range(3, 3 + n))
        for world in range(1, n + 1):
            shares = [rank_cpus(r, world, allowed) for r in range(world)]
            assert sorted(c for s in shares for c in s) == allowed
            assert max(map(len, shares)) - min(map(len, shares)) <= 1
            assert all(s == list(range(s[0], s[0] + len(s))) for s in shares)
    assert rank_cpus(1, 2, [6, 0, 4, 2]) == [4, 6]
    assert [rank_cpus(r, 3, [0, 1]) for r in range(3)] == [[0], [1], [0]]  # fewer cores


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="local rank 2"):
        rank_cpus(2, 2, [0, 1])
    with pytest.raises(ValueError, match="cpu_binding"):
        bind_rank_cpus(0, 2, "numa")


def test_none_or_one_rank_pins_nothing():
    before = os.sched_getaffinity(0)
    assert bind_rank_cpus(0, 2, "none") is None
    assert bind_rank_cpus(0, 1, "auto") is None
    assert os.sched_getaffinity(0) == before


@pytest.mark.parametrize("num_threads", [None, 3])
def test_a_rank_is_pinned_to_its_share_with_as_many_threads(num_threads):
    allowed = sorted(os.sched_getaffinity(0))
    world = min(2, len(allowed))
    script = (
        "import json, os, torch\n"
        "from octavo.distributed.placement import bind_rank_cpus\n"
        f"cpus = bind_rank_cpus({world - 1}, {world}, 'auto', {num_threads})\n"
        "print(json.dumps([cpus, sorted(os.sched_getaffinity(0)), torch.get_num_threads()]))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True).stdout
    cpus, affinity, threads = json.loads(out.splitlines()[-1])
    want = rank_cpus(world - 1, world, allowed)
    if world == 1:
        assert cpus is None
        return
    assert cpus == affinity == want
    assert threads == (num_threads or len(want))
