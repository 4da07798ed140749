"""The automatic prefix cache: chained block hashes, the pool's hash → block map and LRU eviction,
KVCacheManager.get_computed_blocks, the scheduler's use of hits, and a property-based simulation
that checks the block accounting after every operation, the KV content every request reads, and
that outputs never depend on caching."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from octavo.core.block_pool import BlockPool
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.hashing import extend_block_hashes, hash_block
from octavo.core.kv_manager import KVCacheManager, cdiv
from octavo.core.request import Request, RequestStatus
from octavo.params import SamplingParams
from tests.core.core_requests import submit
from tests.core.fakes import EOS, FakeWorker, make_scheduler, step

BS = 4


def req(req_id: str, prompt: list[int], max_tokens: int = 4, salt: str | None = None,
        priority: int = 0, **params) -> Request:
    return Request(req_id, list(prompt), SamplingParams(max_tokens=max_tokens, **params),
                   frozenset({EOS}), max_tokens, priority=priority, cache_salt=salt)


def prompt_of(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def hashes_of(tokens: list[int], block_size: int = BS, extra: tuple = ()) -> list[bytes]:
    out: list[bytes] = []
    extend_block_hashes(out, tokens, block_size, extra)
    return out


def finish(kv: KVCacheManager, r: Request) -> list[int]:
    """Compute the whole prompt of `r` in one go, then free it: its full blocks stay cached."""
    hits, num_hit = kv.get_computed_blocks(r)
    assert kv.allocate_slots(r, r.num_tokens - num_hit, hits) is not None
    r.num_computed_tokens = r.num_tokens
    table = list(kv.blocks_of(r.req_id))
    kv.free(r)
    return table


# -- hashing ---------------------------------------------------------------------------------------

HASH_CODE = ("from octavo.core.hashing import extend_block_hashes; h = []; "
             "extend_block_hashes(h, list(range(3, 40)), 4, ('salt', 'pepper')); "
             "print(','.join(x.hex() for x in h))")


@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_hashes_are_deterministic_across_processes(hash_seed):
    env = dict(os.environ, PYTHONHASHSEED=hash_seed)
    proc = subprocess.run([sys.executable, "-c", HASH_CODE], capture_output=True, text=True,
                          timeout=60, env=env, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))
    assert proc.returncode == 0, proc.stderr
    here = hashes_of(list(range(3, 40)), 4, ("salt", "pepper"))
    assert len(here) == 9
    assert proc.stdout.strip() == ",".join(h.hex() for h in here)


def test_hash_is_sha256_sized_and_depends_on_parent_tokens_and_extra():
    h = hash_block(None, [1, 2, 3, 4])
    assert isinstance(h, bytes) and len(h) == hashlib.sha256().digest_size
    assert hash_block(None, [1, 2, 3, 4]) == h
    assert hash_block(h, [1, 2, 3, 4]) != h
    assert hash_block(None, [1, 2, 3, 5]) != h
    assert hash_block(None, [1, 2, 3, 4], ("salt", "x")) != h


def test_only_full_blocks_are_hashed_and_extending_is_incremental():
    tokens = prompt_of(19)
    full = hashes_of(tokens)
    assert len(full) == 4  # 19 // 4
    partial: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(partial, tokens[:n], BS)
        assert partial == full[:n // BS]


@pytest.mark.parametrize("changed", range(16))
def test_hashes_are_chained(changed):
    tokens = prompt_of(16)
    other = list(tokens)
    other[changed] += 1000
    a, b = hashes_of(tokens), hashes_of(other)
    first_changed = changed // BS
    assert a[:first_changed] == b[:first_changed]
    for i in range(first_changed, 4):
        assert a[i] != b[i], (changed, i)


def test_cache_salt_changes_every_hash():
    tokens = prompt_of(20)
    none = hashes_of(tokens, extra=req("x", tokens).cache_extra_keys())
    a = hashes_of(tokens, extra=req("x", tokens, salt="a").cache_extra_keys())
    b = hashes_of(tokens, extra=req("x", tokens, salt="b").cache_extra_keys())
    empty = hashes_of(tokens, extra=req("x", tokens, salt="").cache_extra_keys())
    assert none == hashes_of(tokens)
    for i in range(5):
        assert len({none[i], a[i], b[i], empty[i]}) == 4, i
    assert a == hashes_of(tokens, extra=req("y", tokens, salt="a").cache_extra_keys())


@pytest.mark.parametrize("salts, shared", [
    (("a", "b"), False), ((None, "a"), False), (("a", None), False), (("", None), False),
    (("a", "a"), True), ((None, None), True)])
def test_salts_decide_sharing(salts, shared):
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = prompt_of(21)
    first = finish(kv, req("first", tokens, salt=salts[0]))
    second = req("second", tokens, salt=salts[1])
    hits, num_hit = kv.get_computed_blocks(second)
    if shared:
        assert hits == first[:5] and num_hit == 20
    else:
        assert hits == [] and num_hit == 0


def test_scheduler_never_shares_blocks_across_salts():
    s = make_scheduler(enable_caching=True)
    tokens = prompt_of(30)
    s.add_request(req("a", tokens, max_tokens=1, salt="alice"))
    step(s)
    assert not s.has_unfinished_requests()
    s.add_request(req("b", tokens, max_tokens=1, salt="bob"))
    s.add_request(req("c", tokens, max_tokens=1))
    s.add_request(req("d", tokens, max_tokens=1, salt="alice"))
    sched, _ = step(s)
    # b and c are admitted in the same step but neither may read the other's blocks.
    assert sched.num_scheduled_tokens == {"b": 30, "c": 30, "d": 2}
    blocks = {n.req_id: n.block_ids for n in sched.new_requests}
    assert not set(blocks["b"]) & set(blocks["c"])
    assert not set(blocks["d"]) & (set(blocks["b"]) | set(blocks["c"]))
    assert [n.num_computed_tokens for n in sched.new_requests] == [0, 0, 28]


# -- BlockPool -------------------------------------------------------------------------------------

H = [hash_block(None, [i]) for i in range(10)]  # fabricated hashes
T = [(i, i, i, i) for i in range(10)]  # and the tokens they stand for


def cached_pool(num_blocks: int, count: int) -> tuple[BlockPool, list[int]]:
    """A pool whose first `count` blocks hold H[i] / T[i], all still referenced."""
    pool = BlockPool(num_blocks)
    blocks = pool.allocate(count)
    for i, b in enumerate(blocks):
        pool.cache(b, H[i], T[i])
    return pool, blocks


def check_pool(pool: BlockPool) -> None:
    plain, cached = set(pool._plain), set(pool._cached_free)
    assert len(plain) == len(pool._plain) and not plain & cached
    assert plain | cached == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
    assert all(pool.block_hash[b] is None for b in plain)
    assert all(pool.block_hash[b] is not None for b in cached)
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h and pool.block_tokens[b] is not None
    for b in range(pool.num_blocks):
        if pool.block_hash[b] is not None:
            assert pool.cached[pool.block_hash[b]] == b
        else:
            assert pool.block_tokens[b] is None


def test_cached_block_is_found_while_referenced_and_after_free():
    pool, (b,) = cached_pool(4, 1)
    assert pool.lookup(H[0], T[0]) == b
    pool.free([b])
    assert pool.is_free(b)
    assert pool.lookup(H[0], T[0]) == b  # idle, still cached
    assert pool.lookup(H[1], T[1]) is None
    check_pool(pool)


def test_cached_free_block_is_findable_until_the_queue_hands_it_out():
    pool, (b,) = cached_pool(4, 1)
    pool.free([b])  # queue: 1, 2, 3, b
    for i in range(3):
        (got,) = pool.allocate(1)
        assert got != b
        assert pool.lookup(H[0], T[0]) == b, i
    assert pool.num_evictions == 0
    assert pool.allocate(1) == [b]
    assert pool.lookup(H[0], T[0]) is None
    assert H[0] not in pool.cached and pool.block_hash[b] is None
    assert pool.num_evictions == 1
    check_pool(pool)


def test_eviction_is_least_recently_freed_first():
    pool, (a, b) = cached_pool(2, 2)
    pool.free([a])
    pool.free([b])
    assert pool.allocate(1) == [a]
    assert pool.lookup(H[0], T[0]) is None
    assert pool.lookup(H[1], T[1]) == b
    check_pool(pool)


def test_eviction_follows_free_order_not_block_ids():
    pool, blocks = cached_pool(4, 4)
    pool.free([blocks[2]])
    pool.free([blocks[0], blocks[3]])
    pool.free([blocks[1]])
    order = [blocks[2], blocks[0], blocks[3], blocks[1]]
    for k, victim in enumerate(order):
        assert pool.allocate(1) == [victim]
        for i, bl in enumerate(blocks):
            expected = None if bl in order[:k + 1] else bl
            assert pool.lookup(H[i], T[i]) == expected


def test_reused_block_moves_to_the_back_of_the_queue():
    pool, (a, b) = cached_pool(2, 2)
    pool.free([a])
    pool.free([b])
    pool.touch([a])  # a request reuses a ...
    pool.free([a])  # ... and lets it go: now b is the least recently freed
    assert pool.allocate(1) == [b]
    assert pool.lookup(H[0], T[0]) == a
    check_pool(pool)


def test_block_in_use_is_never_evicted_or_handed_out():
    pool, (a, b, c) = cached_pool(5, 3)
    pool.free([a, c])
    handed = pool.allocate(4)  # everything free: the two never-used blocks, then a and c
    assert b not in handed and sorted(handed + [b]) == list(range(5))
    assert pool.lookup(H[1], T[1]) == b
    assert pool.ref_counts[b] == 1
    with pytest.raises(RuntimeError):
        pool.allocate(1)
    assert pool.lookup(H[1], T[1]) == b
    check_pool(pool)


def test_touch_on_an_idle_cached_block_takes_it_out_of_the_free_queue():
    pool, (a,) = cached_pool(3, 1)
    pool.free([a])
    assert pool.num_free_blocks == 3
    pool.touch([a])
    assert not pool.is_free(a) and pool.ref_counts[a] == 1
    assert pool.num_free_blocks == 2
    assert a not in pool.allocate(2)
    assert pool.lookup(H[0], T[0]) == a
    check_pool(pool)


def test_touch_on_a_block_in_use_adds_a_reference():
    pool, (a,) = cached_pool(2, 1)
    pool.touch([a])
    pool.touch([a])
    assert pool.ref_counts[a] == 3 and pool.num_free_blocks == 1
    pool.free([a])
    pool.free([a])
    assert not pool.is_free(a)
    pool.free([a])
    assert pool.is_free(a) and pool.lookup(H[0], T[0]) == a
    check_pool(pool)


def test_first_writer_wins():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, H[0], T[0])
    pool.cache(b, H[0], T[0])  # same content computed twice: the first copy stays the cached one
    assert pool.lookup(H[0], T[0]) == a
    assert pool.block_hash[b] is None
    pool.free([a, b])
    # The uncached duplicate goes out first (the most recently freed plain block, then the
    # never-used ones) and does not disturb the cached copy, which goes last.
    assert pool.allocate(1) == [b]
    assert pool.lookup(H[0], T[0]) == a
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [a]
    assert pool.lookup(H[0], T[0]) is None
    check_pool(pool)


def test_a_cached_block_keeps_its_first_hash():
    pool, (a,) = cached_pool(2, 1)
    pool.cache(a, H[1], T[1])
    assert pool.lookup(H[0], T[0]) == a
    assert pool.lookup(H[1], T[1]) is None
    check_pool(pool)


def test_lookup_compares_the_stored_tokens():
    pool, (a,) = cached_pool(2, 1)
    assert pool.lookup(H[0], T[0]) == a
    assert pool.lookup(H[0], list(T[0])) == a
    assert pool.lookup(H[0], (0, 0, 0, 1)) is None  # same hash, different tokens: a miss
    assert pool.lookup(H[0], (0, 0, 0)) is None


def test_get_computed_blocks_stops_at_a_hash_collision():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = prompt_of(12)
    victim = req("v", tokens)
    hashes = hashes_of(tokens)
    # A block holding other tokens registered under the victim's second hash.
    (b,) = kv.pool.allocate(1)
    kv.pool.cache(b, hashes[1], [9, 9, 9, 9])
    (c,) = kv.pool.allocate(1)
    kv.pool.cache(c, hashes[0], tokens[:4])
    assert kv.get_computed_blocks(victim) == ([c], 4)


def test_reset_cache_is_refused_while_a_block_is_in_use():
    pool, (a, b) = cached_pool(3, 2)
    pool.free([a])
    assert pool.reset_cache() is False
    assert pool.lookup(H[0], T[0]) == a and pool.lookup(H[1], T[1]) == b
    check_pool(pool)


def test_reset_cache_forgets_everything_once_all_blocks_are_free():
    pool, blocks = cached_pool(3, 2)
    pool.free(blocks)
    assert pool.reset_cache() is True
    assert pool.cached == {}
    assert pool.block_hash == [None] * 3 and pool.block_tokens == [None] * 3
    assert pool.lookup(H[0], T[0]) is None and pool.lookup(H[1], T[1]) is None
    assert pool.num_free_blocks == 3
    check_pool(pool)
    # Now plain, the formerly cached blocks go out before the never-used one, the most recently
    # freed first (warm memory).
    assert pool.allocate(3) == [blocks[1], blocks[0], 2]


# -- KVCacheManager.get_computed_blocks ------------------------------------------------------------

@pytest.mark.parametrize("shared_blocks", [0, 1, 3, 5])
def test_shares_the_full_blocks_of_a_common_prefix(shared_blocks):
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    first_tokens = prompt_of(22)  # 5 full blocks and a partial one
    first = finish(kv, req("first", first_tokens))
    tokens = first_tokens[:shared_blocks * BS + 1] + [7] * 9  # diverges inside the next block
    if shared_blocks == 5:
        tokens = first_tokens + [7] * 3
    second = req("second", tokens)
    hits, num_hit = kv.get_computed_blocks(second)
    assert hits == first[:shared_blocks]
    assert num_hit == shared_blocks * BS
    assert kv.prefix_queries == kv.prefix_hits == 0  # recorded by the scheduler, not here

    # Taking the hits: shared blocks get a reference and leave the free queue.
    new = kv.allocate_slots(second, second.num_tokens - num_hit, hits)
    assert kv.blocks_of("second") == hits + new
    assert not set(new) & set(first[:5])  # no cached block is evicted while plain ones are free
    for b in hits:
        assert kv.pool.ref_counts[b] == 1 and not kv.pool.is_free(b)
    assert len(new) == cdiv(second.num_tokens, BS) - shared_blocks


@pytest.mark.parametrize("length", range(1, 26))
def test_a_fully_cached_prompt_still_leaves_a_token_to_compute(length):
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    long = prompt_of(24)
    first = finish(kv, req("first", long))
    second = req("second", (long + [7])[:length])
    hits, num_hit = kv.get_computed_blocks(second)
    assert num_hit <= length - 1
    assert num_hit % BS == 0
    assert num_hit == min((length - 1) // BS, 6) * BS  # block aligned, as many as allowed
    assert hits == first[:num_hit // BS]


def test_the_same_prompt_again_hits_all_but_the_last_block():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    first = finish(kv, req("a", prompt_of(16)))
    hits, num_hit = kv.get_computed_blocks(req("b", prompt_of(16)))
    assert (hits, num_hit) == (first[:3], 12)


def test_prompt_logprobs_requests_get_no_hits_but_still_fill_the_cache():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = prompt_of(17)
    finish(kv, req("first", tokens))
    for k in (0, 1, 5):
        assert kv.get_computed_blocks(req(f"lp{k}", tokens, prompt_logprobs=k)) == ([], 0)
    kv2 = KVCacheManager(num_blocks=32, block_size=BS)
    table = finish(kv2, req("lp", tokens, prompt_logprobs=2))
    assert kv2.get_computed_blocks(req("plain", tokens)) == (table[:4], 16)


def test_disabled_caching_gives_no_hits_and_caches_nothing():
    kv = KVCacheManager(num_blocks=32, block_size=BS, enable_caching=False)
    tokens = prompt_of(17)
    finish(kv, req("first", tokens))
    assert kv.pool.cached == {}
    assert all(h is None for h in kv.pool.block_hash)
    assert kv.get_computed_blocks(req("second", tokens)) == ([], 0)


def test_hits_owned_by_a_running_request_are_shared():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    tokens = prompt_of(13)
    a = req("a", tokens)
    kv.allocate_slots(a, 13)  # cached at allocation: a computes these tokens this step
    b = req("b", tokens)
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == kv.blocks_of("a")[:3] and num_hit == 12
    assert kv.allocate_slots(b, 1, hits) is not None
    assert [kv.pool.ref_counts[x] for x in kv.blocks_of("b")] == [2, 2, 2, 1]
    assert kv.blocks_of("b")[3] != kv.blocks_of("a")[3]  # the partial block is never shared
    assert kv.pool.num_free_blocks == 32 - 5


def test_idle_hits_count_against_free_blocks_exactly():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = prompt_of(16)
    first = finish(kv, req("first", tokens[:8]))  # blocks 0 and 1, idle and cached
    assert kv.pool.num_free_blocks == 4
    b = req("b", tokens)
    hits, num_hit = kv.get_computed_blocks(b)
    assert (hits, num_hit) == (first, 8)
    new = kv.allocate_slots(b, 8, hits)
    assert new is not None and len(new) == 2 and not set(new) & set(first)
    assert kv.blocks_of("b") == first + new
    assert kv.pool.num_free_blocks == 0


def test_allocation_that_does_not_fit_with_hits_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = prompt_of(20)
    first = finish(kv, req("first", tokens[:8]))
    b = req("b", tokens)
    hits, num_hit = kv.get_computed_blocks(b)
    assert hits == first
    # 8 hit tokens + 12 more need 5 blocks; only 4 exist.
    assert kv.allocate_slots(b, 12, hits) is None
    assert kv.blocks_of("b") == [] and "b" not in kv.block_tables
    assert kv.pool.num_free_blocks == 4
    assert all(kv.pool.ref_counts[x] == 0 for x in range(4))
    assert kv.get_computed_blocks(req("c", tokens)) == (first, 8)


def test_decode_blocks_are_cached_once_full_and_computed():
    kv = KVCacheManager(num_blocks=32, block_size=BS)
    a = req("a", prompt_of(6), max_tokens=8)
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    assert len(kv.pool.cached) == 1
    a.output_token_ids += [50, 51]  # tokens 6 and 7 exist; 7 is not computed yet
    kv.allocate_slots(a, 1)
    a.num_computed_tokens = 7
    assert len(kv.pool.cached) == 1  # the second block is full but its last slot unwritten
    a.output_token_ids.append(52)
    kv.allocate_slots(a, 1)
    a.num_computed_tokens = 8
    assert len(kv.pool.cached) == 2
    table = list(kv.blocks_of("a"))
    kv.free(a)
    hits, num_hit = kv.get_computed_blocks(req("b", prompt_of(6) + [50, 51, 52]))
    assert (hits, num_hit) == (table[:2], 8)


# -- the scheduler ---------------------------------------------------------------------------------

def test_second_request_computes_only_its_suffix():
    s = make_scheduler(num_blocks=64, block_size=BS, enable_caching=True)
    worker = FakeWorker(BS)
    shared = prompt_of(34)
    s.add_request(req("a", shared + [1, 1, 1, 1, 1, 1], max_tokens=2))
    sched = s.schedule()
    a_blocks = list(sched.new_requests[0].block_ids)
    assert s.requests["a"].num_cached_tokens == 0
    s.update_from_output(sched, worker.execute(sched))
    outs = []
    while s.has_unfinished_requests():
        sched = s.schedule()
        outs += s.update_from_output(sched, worker.execute(sched))
    assert [o.num_cached_tokens for o in outs] == [0]

    b = req("b", shared + [9] * 10, max_tokens=3)
    s.add_request(b)
    sched = s.schedule()
    (new,) = sched.new_requests
    assert new.num_computed_tokens == 32  # the 8 full blocks of the shared 34 tokens
    assert new.block_ids[:8] == a_blocks[:8]
    assert sched.num_scheduled_tokens == {"b": 44 - 32}
    assert b.num_computed_tokens == 44 and b.num_cached_tokens == 32
    outs = s.update_from_output(sched, worker.execute(sched))
    assert [(o.req_id, o.num_cached_tokens) for o in outs] == [("b", 32)]
    assert outs[0].first_scheduled_time is not None
    while s.has_unfinished_requests():
        sched = s.schedule()
        outs = s.update_from_output(sched, worker.execute(sched))
        assert all(o.num_cached_tokens == 32 for o in outs)
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (40 + 44, 32)


def test_caching_disabled_reports_no_cached_tokens():
    s = make_scheduler(num_blocks=64, block_size=BS, enable_caching=False)
    for name in "ab":
        s.add_request(req(name, prompt_of(20), max_tokens=1))
        sched, outs = step(s)
        assert sched.num_scheduled_tokens == {name: 20}
        assert [o.num_cached_tokens for o in outs] == [0]
    assert s.kv.pool.cached == {}
    assert s.stats().prefix_cache_hits == 0


@pytest.mark.parametrize("n", [2, 3, 5])
def test_siblings_added_together_share_the_prompt_in_the_same_step(n):
    s = make_scheduler(num_blocks=64, block_size=BS, max_num_batched_tokens=64,
                       enable_caching=True)
    worker = FakeWorker(BS)
    tokens = prompt_of(18)  # 4 full blocks and 2 tokens
    for i in range(n):
        s.add_request(req(f"s{i}", tokens, max_tokens=2))
    sched = s.schedule()
    assert sched.num_scheduled_tokens == {"s0": 18, **{f"s{i}": 2 for i in range(1, n)}}
    tables = {new.req_id: new.block_ids for new in sched.new_requests}
    shared = tables["s0"][:4]
    for i in range(1, n):
        assert tables[f"s{i}"][:4] == shared
        assert s.requests[f"s{i}"].num_cached_tokens == 16
    assert all(s.kv.pool.ref_counts[b] == n for b in shared)
    partials = [tables[f"s{i}"][4] for i in range(n)]
    assert len(set(partials)) == n
    assert s.kv.pool.num_free_blocks == 64 - 4 - n
    outs = s.update_from_output(sched, worker.execute(sched))
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [16] * (n - 1)
    stats = s.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (18 * n, 16 * (n - 1))


def test_sibling_waits_for_a_chunked_prompt_then_hits_its_last_chunk_too():
    s = make_scheduler(num_blocks=64, block_size=BS, max_num_batched_tokens=24,
                       enable_caching=True)
    tokens = prompt_of(30)
    s.add_request(req("a", tokens, max_tokens=1))
    s.add_request(req("b", tokens, max_tokens=1))
    sched, _ = step(s)
    assert sched.num_scheduled_tokens == {"a": 24}  # the first chunk takes the whole budget
    a_blocks = list(sched.new_requests[0].block_ids)
    sched, _ = step(s)
    a_blocks += sched.cached_requests[0].new_block_ids
    # a's last chunk completes 7 full blocks in this step; b takes them and computes 2 tokens.
    assert sched.num_scheduled_tokens == {"a": 6, "b": 2}
    (new,) = sched.new_requests
    assert new.num_computed_tokens == 28
    assert len(a_blocks) == 8 and new.block_ids[:7] == a_blocks[:7]
    assert new.block_ids[7] != a_blocks[7]


def test_preempted_request_finds_its_blocks_again():
    # 8 blocks of 4: two 12-token prompts fill 6; decoding runs out of blocks and preempts b.
    s = make_scheduler(num_blocks=8, block_size=BS, max_num_batched_tokens=64,
                       max_model_len=32, enable_caching=True)
    worker = FakeWorker(BS)
    s.add_request(req("a", prompt_of(12), max_tokens=7, ignore_eos=True))
    s.add_request(req("b", prompt_of(12, start=300), max_tokens=10, ignore_eos=True))
    b_table: list[int] = []
    preempted_at = None
    resumed = None
    for i in range(100):
        if not s.has_unfinished_requests():
            break
        sched = s.schedule()
        if "b" in sched.preempted_req_ids:
            preempted_at = i
        for new in sched.new_requests:
            if new.req_id == "b" and preempted_at is not None and resumed is None:
                resumed = new
                assert s.requests["b"].status == RequestStatus.RUNNING
        s.update_from_output(sched, worker.execute(sched))
        if "b" in s.kv.block_tables and preempted_at is None:
            b_table = list(s.kv.blocks_of("b"))
    assert preempted_at is not None and resumed is not None
    b = s.requests.get("b")
    assert b is None  # finished
    # b's leading blocks survived (a needed only one more block); its recompute starts there.
    assert resumed.num_computed_tokens > 0
    assert resumed.num_computed_tokens % BS == 0
    k = resumed.num_computed_tokens // BS
    assert resumed.block_ids[:k] == b_table[:k]
    assert k >= 3


def test_preempted_request_resumes_with_its_own_tokens_hit():
    s = make_scheduler(num_blocks=8, block_size=BS, max_num_batched_tokens=64,
                       max_model_len=32, enable_caching=True)
    s.add_request(req("a", prompt_of(12), max_tokens=7, ignore_eos=True))
    s.add_request(req("b", prompt_of(12, start=300), max_tokens=10, ignore_eos=True))
    news = []
    while s.has_unfinished_requests():
        sched, _ = step(s)
        news += [(n.req_id, n.num_computed_tokens, len(n.token_ids)) for n in sched.new_requests]
    assert s.num_preemptions >= 1
    resumes = [x for x in news if x[0] == "b"][1:]
    assert resumes and all(0 < hit < total for _, hit, total in resumes)
    stats = s.stats()
    first = {}
    for req_id, hit, total in news:  # resumptions are not counted again
        first.setdefault(req_id, (hit, total))
    assert stats.prefix_cache_queries == sum(total for _, total in first.values())
    assert stats.prefix_cache_hits == sum(hit for hit, _ in first.values())


def test_prompt_logprobs_request_is_scheduled_for_its_whole_prompt():
    s = make_scheduler(num_blocks=64, block_size=BS, enable_caching=True)
    tokens = prompt_of(20)
    s.add_request(req("a", tokens, max_tokens=1))
    step(s)
    s.add_request(req("b", tokens, max_tokens=1, prompt_logprobs=1))
    sched, _ = step(s)
    assert sched.num_scheduled_tokens == {"b": 20}
    assert sched.new_requests[0].num_computed_tokens == 0


def test_engine_core_reset_prefix_cache():
    from tests.core.test_engine_core import make_core

    core, _ = make_core(num_blocks=32, block_size=BS, max_model_len=64)
    assert core.scheduler.kv.enable_caching
    tokens = prompt_of(20)
    submit(core, req("a", tokens, max_tokens=3))
    core.step()
    assert core.reset_prefix_cache() is False  # a is still running
    while core.has_unfinished_requests():
        core.step()
    assert core.scheduler.kv.pool.cached
    assert core.reset_prefix_cache() is True
    assert core.scheduler.kv.pool.cached == {}
    submit(core, req("b", tokens, max_tokens=1))
    outs = core.step()
    assert [o.num_cached_tokens for o in outs] == [0]


# -- property-based simulation ---------------------------------------------------------------------

def sim_token(req_id: str, token_ids: list[int]) -> int:
    """The sampled token: a function of the request's seed (in its id) and every token so far."""
    seed = req_id.split("s", 1)[1]
    digest = hashlib.sha256(f"{seed}:{token_ids}".encode()).digest()
    return EOS if digest[0] < 20 else 3 + digest[1] % 5


class SimWorker(FakeWorker):
    """FakeWorker plus a simulated KV cache: computing position p of a request writes a key for
    the request's tokens [0, p] into its slot, and every request must read back exactly its own
    keys for every position it has computed, whoever wrote them. The cache salt is part of
    the key: KV computed under another salt reads as wrong."""

    def __init__(self, block_size: int, salts: dict[str, str | None]) -> None:
        super().__init__(block_size)
        self.salts = salts
        self.mem: dict[tuple[int, int], int] = {}
        self.keys: dict[str, list[int]] = {}  # req_id -> the keys of its tokens, by position

    def _keys(self, req_id: str, token_ids: list[int]) -> list[int]:
        keys = self.keys.setdefault(req_id, [])
        for p in range(len(keys), len(token_ids)):
            parent = keys[-1] if keys else ("salt", self.salts[req_id])
            keys.append(hash((parent, token_ids[p])))
        return keys

    def _slot(self, block_ids: list[int], p: int) -> tuple[int, int]:
        return block_ids[p // self.block_size], p % self.block_size

    def drop(self, req_id: str) -> None:
        super().drop(req_id)
        self.keys.pop(req_id, None)

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.apply(sched)
        # Write the KV of every scheduled position first (all requests of the batch), as each
        # layer does before attention, then read.
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            keys = self._keys(req_id, state.token_ids)
            assert n >= 1 and state.num_computed + n <= len(state.token_ids)
            assert len(state.block_ids) * self.block_size >= state.num_computed + n
            for p in range(state.num_computed, state.num_computed + n):
                self.mem[self._slot(state.block_ids, p)] = keys[p]
        req_ids, sampled = [], []
        for req_id, n in sched.num_scheduled_tokens.items():
            state = self.reqs[req_id]
            state.num_computed += n
            req_ids.append(req_id)
            if state.num_computed == len(state.token_ids):
                tok = sim_token(req_id, state.token_ids)
                state.sampled = [tok]  # the worker holds it once the core sends it back
                sampled.append([tok])
            else:
                sampled.append([])
        self.check_memory()
        return ModelOutput(req_ids, sampled)

    def check_memory(self) -> None:
        """Every request the worker holds finds its own keys at every computed position."""
        for req_id, state in self.reqs.items():
            keys = self._keys(req_id, state.token_ids)
            for p in range(state.num_computed):
                assert self.mem.get(self._slot(state.block_ids, p)) == keys[p], (
                    f"{req_id} reads a wrong KV at position {p}")


def check_cache_invariants(s) -> None:
    kv, pool = s.kv, s.kv.pool
    bs, n = kv.block_size, pool.num_blocks
    tables = kv.block_tables
    counts = Counter(b for t in tables.values() for b in t)
    for b in range(n):
        assert pool.ref_counts[b] == counts[b], b
    assert set(pool._plain) | set(pool._cached_free) == {b for b in range(n)
                                                         if pool.ref_counts[b] == 0}
    assert len(pool._plain) + len(pool._cached_free) == pool.num_free_blocks
    for h, b in pool.cached.items():
        assert pool.block_hash[b] == h
        assert pool.block_tokens[b] is not None and len(pool.block_tokens[b]) == bs
    for b in range(n):
        if pool.block_hash[b] is not None:
            assert pool.cached[pool.block_hash[b]] == b
    for t in tables.values():
        assert len(t) == len(set(t))
    assert len(counts) == n - pool.num_free_blocks
    assert set(tables) == {r.req_id for r in s.running}
    if not kv.enable_caching:
        assert pool.cached == {}
    for r in s.running:
        t = tables[r.req_id]
        assert len(t) == cdiv(r.num_computed_tokens, bs)
        tokens = r.all_token_ids
        for i, b in enumerate(t):
            if pool.block_hash[b] is not None:  # a cached block in a table is that table's block
                assert (i + 1) * bs <= r.num_computed_tokens
                assert pool.block_hash[b] == r.block_hashes[i]
                assert pool.block_tokens[b] == tuple(tokens[i * bs:(i + 1) * bs])
    for r in s.waiting:
        assert r.num_computed_tokens == 0 and r.req_id not in tables
    assert len(s.running) + len(s.waiting) == len(s.requests)


PREFIXES = [[10 + 100 * k + i for i in range(64)] for k in range(3)]


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(12, 24))
    max_model_len = draw(st.integers(num_blocks * block_size // 3, num_blocks * block_size))
    cfg = dict(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len,
               max_num_seqs=draw(st.integers(2, 6)),
               max_num_batched_tokens=draw(st.integers(4, 32)),
               scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
               priority_aging_steps=draw(st.sampled_from([0, 0, 3])))
    add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 64),
                    st.lists(st.integers(3, 6), max_size=6), st.integers(1, 16),
                    st.sampled_from([None, None, "x", "y"]), st.integers(0, 1),
                    st.integers(0, 1), st.sampled_from([None, None, None, None, 1]))
    step_op = st.tuples(st.just("step"), st.integers(1, 4))
    abort = st.tuples(st.just("abort"), st.integers(0, 40))
    ops = draw(st.lists(st.one_of(add, step_op, add, step_op, abort), min_size=10, max_size=40))
    return cfg, ops, draw(st.booleans())


def run_workload(cfg, ops, drain: bool, enable_caching: bool):
    s = make_scheduler(enable_caching=enable_caching, **cfg)
    salts: dict[str, str | None] = {}
    worker = SimWorker(cfg["block_size"], salts)
    added: list[str] = []
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    cached: dict[str, int] = {}
    queries = hits = 0
    first_admitted: set[str] = set()
    logprob_reqs: set[str] = set()

    def do_step():
        nonlocal queries, hits
        had_work = s.has_unfinished_requests()
        sched = s.schedule()
        check_cache_invariants(s)
        if had_work:
            assert sched.total_num_scheduled_tokens > 0
        for new in sched.new_requests:
            if new.req_id not in first_admitted:  # a prompt's lookup counts once
                first_admitted.add(new.req_id)
                queries += len(new.token_ids)
                hits += new.num_computed_tokens
            assert new.num_computed_tokens % cfg["block_size"] == 0
            assert new.num_computed_tokens <= len(new.token_ids) - 1
            if new.req_id in logprob_reqs or not enable_caching:
                assert new.num_computed_tokens == 0
        for o in s.update_from_output(sched, worker.execute(sched)):
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            cached.setdefault(o.req_id, o.num_cached_tokens)
            assert cached[o.req_id] == o.num_cached_tokens
            if o.finish_reason is not None:
                reasons[o.req_id] = o.finish_reason
        check_cache_invariants(s)

    for op in ops:
        if op[0] == "add":
            _, k, plen, suffix, max_tokens, salt, seed, priority, prompt_lp = op
            prompt = (PREFIXES[k][:plen] + suffix)[:cfg["max_model_len"] - 1] or [5]
            req_id = f"r{len(added)}s{seed}"
            if prompt_lp is not None:
                logprob_reqs.add(req_id)
            salts[req_id] = salt
            s.add_request(req(req_id, prompt, max_tokens, salt=salt, priority=priority,
                              prompt_logprobs=prompt_lp))
            added.append(req_id)
        elif op[0] == "step":
            for _ in range(op[1]):
                do_step()
        else:
            if added:
                victim = added[op[1] % len(added)]
                if s.abort_requests([victim]):
                    reasons[victim] = "abort"
        check_cache_invariants(s)

    if drain:
        for _ in range(2000):
            if not s.has_unfinished_requests():
                break
            do_step()
        assert not s.has_unfinished_requests()
    for req_id in s.abort_requests(list(s.requests)):
        reasons[req_id] = "abort"
    s.schedule()
    check_cache_invariants(s)
    pool = s.kv.pool
    assert pool.ref_counts == [0] * pool.num_blocks
    assert pool.num_free_blocks == pool.num_blocks and s.kv.block_tables == {}
    assert not s.running and not s.waiting
    stats = s.stats()
    assert stats.prefix_cache_hits == hits
    if enable_caching:
        assert stats.prefix_cache_queries == queries
    assert stats.kv_cache_usage == 0.0
    assert s.kv.reset_prefix_cache() is True and pool.cached == {}
    return added, tokens, reasons, hits, s.num_preemptions


def compare_runs(cfg, ops, drain):
    added, plain, plain_reasons, plain_hits, _ = run_workload(cfg, ops, drain, False)
    added2, cached, cached_reasons, hits, preemptions = run_workload(cfg, ops, drain, True)
    assert added == added2 and plain_hits == 0
    for req_id in added:
        a, b = plain.get(req_id, []), cached.get(req_id, [])
        n = min(len(a), len(b))
        assert a[:n] == b[:n], req_id  # the same tokens as far as both got
        ra, rb = plain_reasons.get(req_id), cached_reasons.get(req_id)
        if ra not in (None, "abort") and rb not in (None, "abort"):
            assert (a, ra) == (b, rb), req_id
        if drain:
            assert ra is not None and rb is not None
    return hits, preemptions


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_cache_consistent_and_outputs_unchanged(workload):
    cfg, ops, drain = workload
    compare_runs(cfg, ops, drain)


def test_random_workloads_hit_the_cache_and_preempt():
    """Seeded workloads of the property test's kind: the cache does serve hits, and requests do
    get preempted (and resume) while it does, so the checks above are not vacuous."""
    import random

    results = []
    for seed in range(10):
        cfg, ops = seeded_workload(random.Random(seed), add_below=0.4, step_below=0.9,
                                   priorities=(0, 1))
        results.append(compare_runs(cfg, ops, drain=True))
    assert sum(hits > 0 for hits, _ in results) >= 5, results
    assert sum(p > 0 for _, p in results) >= 2, results


def seeded_workload(rng, add_below: float, step_below: float, priorities: tuple[int, int],
                    **config) -> tuple[dict, list]:
    """A small pool and 40 random operations (add / step / abort) for compare_runs."""
    block_size = rng.choice([2, 4])
    num_blocks = rng.randint(12, 24)
    cfg = dict(num_blocks=num_blocks, block_size=block_size,
               max_model_len=rng.randint(num_blocks * block_size // 3, num_blocks * block_size),
               max_num_seqs=rng.randint(2, 6), max_num_batched_tokens=rng.randint(4, 32),
               **config)
    ops = []
    for _ in range(40):
        x = rng.random()
        if x < add_below:
            ops.append(("add", rng.randrange(3), rng.randint(0, 64),
                        [rng.randint(3, 6) for _ in range(rng.randint(0, 6))],
                        rng.randint(1, 16), rng.choice([None, None, "x"]),
                        rng.randint(0, 1), rng.randint(*priorities), None))
        elif x < step_below:
            ops.append(("step", rng.randint(1, 4)))
        else:
            ops.append(("abort", rng.randint(0, 40)))
    return cfg, ops
