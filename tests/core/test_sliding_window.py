"""Blocks behind the sliding window are given back when every layer slides: the KV manager's
bookkeeping, and a simulation that checks no key inside any query's window is ever overwritten."""
from __future__ import annotations

import random

import pytest

from octavo.config import SchedulerConfig
from octavo.core.kv_manager import KVCacheManager, cdiv
from octavo.core.request import RequestStatus
from octavo.core.scheduler import Scheduler
from tests.core.fakes import make_request, run_to_completion, simple_model_output


def _scheduler(num_blocks: int, block_size: int, window: int | None, budget: int = 8,
               max_model_len: int = 256, caching: bool = False) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window=window)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget), kv,
                     max_model_len)


def test_blocks_behind_the_window_are_released_as_the_request_advances():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False, sliding_window=6)
    req = make_request("r", prompt_len=40)
    for computed in range(0, 40, 4):
        req.num_computed_tokens = computed
        kv.allocate_slots(req, 4)
        # The chunk's first query (at `computed`) reads keys from computed - 5 on.
        first_key = max(computed - 5, 0)
        assert kv.num_held_blocks("r") == cdiv(computed + 4, 4) - first_key // 4
        assert len(kv.blocks_of("r")) == cdiv(computed + 4, 4)  # ids stay, positions still map
    assert kv.pool.num_free_blocks == 32 - kv.num_held_blocks("r")
    kv.free(req)  # only the held blocks are dropped: a double free would raise
    assert kv.pool.num_free_blocks == 32


def test_without_a_window_nothing_is_released():
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_caching=False)
    req = make_request("r", prompt_len=40)
    for computed in range(0, 40, 4):
        req.num_computed_tokens = computed
        kv.allocate_slots(req, 4)
    assert kv.num_held_blocks("r") == 10


def test_bad_window_raises():
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        KVCacheManager(8, 4, sliding_window=0)


def test_a_long_request_fits_a_pool_smaller_than_its_length():
    """72 tokens need 18 blocks of 4 without the window; with a window of 8 at most 5 are held,
    so six blocks serve the request without preemption."""
    s = _scheduler(num_blocks=6, block_size=4, window=8, max_model_len=80)
    s.add_request(make_request("a", prompt_len=40, max_tokens=32))
    peak = 0
    while s.has_unfinished_requests():
        sched = s.schedule()
        peak = max(peak, s.kv.num_held_blocks("a"))
        s.update_from_output(sched, simple_model_output(s, sched))
    assert s.num_preemptions == 0 and peak <= 5
    assert s.kv.pool.num_free_blocks == 6

    plain = _scheduler(num_blocks=6, block_size=4, window=None, max_model_len=80)
    plain.add_request(make_request("a", prompt_len=40, max_tokens=32))
    with pytest.raises(AssertionError, match="did not finish"):
        run_to_completion(plain, max_steps=200)  # preempted over and over: it never fits


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_simulated_kv_inside_every_window_stays_intact(seed, caching):
    """Write (request, position) into each computed slot; every query must find exactly its own
    keys at every position inside its window, under preemption and interleaving."""
    rng = random.Random(seed)
    window, bs = rng.choice([(5, 4), (8, 4), (16, 4), (3, 2)])
    s = _scheduler(num_blocks=14, block_size=bs, window=window, budget=rng.choice([3, 8, 13]),
                   caching=caching)
    lengths = {}
    for i in range(6):
        prompt = rng.randint(1, 40)
        req = make_request(f"r{i}", prompt_len=prompt, max_tokens=rng.randint(1, 30))
        lengths[req.req_id] = prompt
        s.add_request(req)
    slots: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose last K/V it holds
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        sched = s.schedule()
        for rid, n in sched.num_scheduled_tokens.items():
            req = s.requests[rid]
            assert req.status == RequestStatus.RUNNING
            table = s.kv.blocks_of(rid)
            tokens = req.all_token_ids
            start = req.num_computed_tokens - n
            for q in range(start, start + n):
                slots[table[q // bs] * bs + q % bs] = tuple(tokens[:q + 1])
                for k in range(max(0, q - window + 1), q + 1):
                    got = slots.get(table[k // bs] * bs + k % bs)
                    assert got == tuple(tokens[:k + 1]), f"{rid}: key {k} of query {q} lost"
                    assert s.kv.pool.ref_counts[table[k // bs]] > 0
        s.update_from_output(sched, simple_model_output(s, sched))
    assert not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == 14


def test_a_cached_prefix_longer_than_the_pool_is_taken_and_released():
    """A long cached prefix whose blocks fill most of the pool is still admitted: the hits behind
    the window are given back at once instead of counting against the free blocks."""
    s = _scheduler(num_blocks=11, block_size=4, window=4, budget=8, max_model_len=80,
                   caching=True)
    s.add_request(make_request("first", prompt_len=40, max_tokens=1))
    run_to_completion(s)
    assert len(s.kv.pool.cached) == 10  # every full block of the first prompt stayed cached
    s.add_request(make_request("again", prompt_len=52, max_tokens=4))  # the same 40 + 12 more
    sched = s.schedule()
    assert sched.new_requests and sched.new_requests[0].num_computed_tokens == 40
    assert s.kv.num_held_blocks("again") <= 4
    s.update_from_output(sched, simple_model_output(s, sched))
    run_to_completion(s)
    assert s.kv.pool.num_free_blocks == 11
