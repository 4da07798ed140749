"""BlockPool: ids, reference counts, the FIFO free queue."""
from __future__ import annotations

import pytest

from octavo.core.block_pool import BlockPool


@pytest.mark.parametrize("n", [0, -1])
def test_needs_at_least_one_block(n):
    with pytest.raises(ValueError):
        BlockPool(n)


def test_fresh_pool_is_all_free():
    pool = BlockPool(5)
    assert pool.num_blocks == 5
    assert pool.num_free_blocks == 5
    assert pool.ref_counts == [0] * 5
    assert pool.usage() == 0.0


def test_allocate_hands_out_distinct_blocks_with_ref_count_one():
    pool = BlockPool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(a) == 3 and len(b) == 5
    assert len(set(a) | set(b)) == 8
    assert all(pool.ref_counts[x] == 1 for x in a + b)
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0


def test_allocate_zero_is_a_no_op():
    pool = BlockPool(2)
    assert pool.allocate(0) == []
    assert pool.num_free_blocks == 2


def test_allocate_too_many_raises_and_changes_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(RuntimeError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1
    assert sorted(pool.ref_counts) == [0, 1, 1, 1]


def test_free_returns_blocks_and_resets_ref_counts():
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    pool.free(blocks)
    assert pool.num_free_blocks == 4
    assert pool.ref_counts == [0] * 4
    assert pool.usage() == 0.0


def test_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.free(blocks)
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free([blocks[0]])
    assert pool.num_free_blocks == 4


def test_double_free_within_one_call_raises():
    pool = BlockPool(4)
    (b,) = pool.allocate(1)
    with pytest.raises(RuntimeError):
        pool.free([b, b])
    # The first reference was dropped; the block is back exactly once.
    assert pool.num_free_blocks == 4
    assert pool.ref_counts[b] == 0


def test_freeing_a_never_allocated_block_raises():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.free([2])
    assert pool.num_free_blocks == 4


def test_shared_block_is_freed_only_by_its_last_reference():
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.ref_counts[b] += 1  # a second holder, as sharing a prefix would add
    pool.free([b])
    assert pool.ref_counts[b] == 1
    assert pool.num_free_blocks == 2  # still held
    pool.free([b])
    assert pool.ref_counts[b] == 0
    assert pool.num_free_blocks == 3
    with pytest.raises(RuntimeError):
        pool.free([b])


def test_fresh_pool_allocates_in_id_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]


def test_most_recently_freed_plain_block_is_reused_first():
    """Blocks without cached content go out warm: their pages are mapped and may be in cache."""
    pool = BlockPool(6)
    blocks = pool.allocate(6)
    assert blocks == [0, 1, 2, 3, 4, 5]
    pool.free([4])
    pool.free([1, 5])
    pool.free([0])
    assert pool.allocate(4) == [0, 5, 1, 4]


def test_freed_blocks_come_before_never_used_ones():
    pool = BlockPool(4)
    assert pool.allocate(1) == [0]
    pool.free([0])
    assert pool.allocate(4) == [0, 1, 2, 3]


def test_cached_blocks_go_out_last_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.cache(a, ("h", 0), (1,))
    pool.cache(b, ("h", 1), (2,))
    pool.free([b])
    pool.free([a, c])
    assert pool.allocate(2) == [c, 3]  # plain ones first
    assert pool.lookup(("h", 0), (1,)) == a and pool.lookup(("h", 1), (2,)) == b
    assert pool.allocate(1) == [b]  # then the LRU of cached ones, evicting its content
    assert pool.lookup(("h", 1), (2,)) is None and pool.lookup(("h", 0), (1,)) == a
