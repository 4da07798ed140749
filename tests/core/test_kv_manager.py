"""KVCacheManager: per-request block tables on top of the pool."""
from __future__ import annotations

import math

import pytest

from octavo.core.kv_manager import KVCacheManager, cdiv
from octavo.core.request import Request
from octavo.params import SamplingParams

EOS = 2


def make_request(req_id: str = "r", prompt_len: int = 10, max_tokens: int = 8) -> Request:
    return Request(req_id, list(range(10, 10 + prompt_len)), SamplingParams(max_tokens=max_tokens),
                   frozenset({EOS}), max_tokens)


def test_cdiv_is_ceil():
    for b in (1, 2, 3, 16):
        for a in range(0, 70):
            assert cdiv(a, b) == math.ceil(a / b), (a, b)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 15, 16, 17, 31, 32, 33, 64])
def test_blocks_needed_is_ceil(block_size, num_tokens):
    kv = KVCacheManager(num_blocks=64, block_size=block_size)
    req = make_request(prompt_len=num_tokens)
    new = kv.allocate_slots(req, num_tokens)
    assert len(new) == math.ceil(num_tokens / block_size)
    assert kv.blocks_of("r") == new
    assert kv.pool.num_free_blocks == 64 - len(new)


def test_exactly_one_block_then_one_more_token():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    req = make_request(prompt_len=17)
    assert len(kv.allocate_slots(req, 16)) == 1
    req.num_computed_tokens = 16
    new = kv.allocate_slots(req, 1)  # token 17 starts block 2
    assert len(new) == 1
    assert len(kv.blocks_of("r")) == 2


def test_block_size_plus_one_at_once_needs_two_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=16)
    assert len(kv.allocate_slots(make_request(prompt_len=17), 17)) == 2


def test_growing_inside_a_block_allocates_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    req = make_request()
    assert len(kv.allocate_slots(req, 1)) == 1
    for computed in (1, 2, 3):
        req.num_computed_tokens = computed
        assert kv.allocate_slots(req, 1) == []
    req.num_computed_tokens = 4
    assert len(kv.allocate_slots(req, 1)) == 1
    assert len(kv.blocks_of("r")) == 2


def test_decode_one_token_at_a_time_matches_ceil():
    bs = 4
    kv = KVCacheManager(num_blocks=16, block_size=bs)
    req = make_request()
    for n in range(1, 50):
        req.num_computed_tokens = n - 1
        kv.allocate_slots(req, 1)
        assert len(kv.blocks_of("r")) == math.ceil(n / bs)


def test_too_few_blocks_returns_none_and_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a, b = make_request("a"), make_request("b")
    first = kv.allocate_slots(a, 8)  # 2 blocks
    assert len(first) == 2
    assert kv.allocate_slots(b, 5) is None  # would need 2, 1 free
    assert "b" not in kv.block_tables
    assert kv.blocks_of("b") == []
    assert kv.pool.num_free_blocks == 1
    # A request that already holds blocks keeps them untouched.
    a.num_computed_tokens = 8
    assert kv.allocate_slots(a, 5) is None
    assert kv.blocks_of("a") == first
    assert kv.pool.num_free_blocks == 1


def test_free_returns_every_block_and_is_idempotent():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a, b = make_request("a"), make_request("b")
    kv.allocate_slots(a, 9)
    kv.allocate_slots(b, 4)
    assert kv.pool.num_free_blocks == 4
    kv.free(a)
    assert kv.pool.num_free_blocks == 7
    assert kv.blocks_of("a") == []
    kv.free(a)  # nothing left to free: no error, no double free
    kv.free(make_request("never-seen"))
    assert kv.pool.num_free_blocks == 7
    kv.free(b)
    assert kv.pool.num_free_blocks == 8
    assert kv.pool.ref_counts == [0] * 8
    assert kv.usage() == 0.0


def test_free_hands_blocks_back_tail_first():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a")
    assert kv.allocate_slots(a, 6) == [0, 1, 2]
    kv.free(a)
    assert kv.allocate_slots(make_request("b"), 6) == [2, 1, 0]


def test_tables_of_different_requests_never_share_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=2)
    reqs = [make_request(f"r{i}") for i in range(4)]
    for i, r in enumerate(reqs):
        kv.allocate_slots(r, 2 * i + 1)
    owned = [b for r in reqs for b in kv.blocks_of(r.req_id)]
    assert len(owned) == len(set(owned)) == 1 + 2 + 3 + 4
    assert kv.usage() == pytest.approx(1.0)
