"""Saved recurrent states (core/state_checkpoints.py) as the KV manager plans and finds them."""
from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.core.kv_manager import KVCacheManager
from octavo.core.request import Request
from octavo.core.state_checkpoints import StateCheckpoints
from octavo.params import SamplingParams

BLOCK, INTERVAL = 4, 8


def _request(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), frozenset({2}), 4)


def _manager(slots: int = 4) -> KVCacheManager:
    return KVCacheManager(64, BLOCK, checkpoints=StateCheckpoints(slots, INTERVAL))


def _run(kv: KVCacheManager, req: Request, chunks: list[int]) -> list[list[tuple[int, int]]]:
    """Schedule `req` in these chunks, a step each; the saves planned at each."""
    hits, num_hit = kv.get_computed_blocks(req)
    kv.begin_step()
    kv.allocate_slots(req, chunks[0], hits)
    req.num_computed_tokens = num_hit
    planned = []
    for i, n in enumerate(chunks):
        if i:
            kv.begin_step()
            kv.allocate_slots(req, n)
        planned.append(kv.plan_state_saves(req, req.num_computed_tokens, n))
        req.num_computed_tokens += n
    return planned


def test_saves_fall_on_boundaries_inside_chunks_and_hits_end_at_them():
    kv = _manager()
    tokens = list(range(100, 130))  # 30 tokens: boundaries at 8, 16, 24
    first = _request("a", tokens)
    saves = _run(kv, first, [10, 11, 9])
    assert [[t for t, _ in step] for step in saves] == [[8], [6], [3]]  # tokens into each step
    assert len({slot for step in saves for _, slot in step}) == 3
    # a prompt sharing 22 tokens: its cached blocks cover 20, the last saved boundary is 16
    other = _request("b", tokens[:22] + [7, 7, 7])
    hits, num_hit = kv.get_computed_blocks(other)
    assert num_hit == 16 and len(hits) == 4
    assert kv.state_restore(other, num_hit) == saves[1][0][1]
    assert kv.state_restore(other, 0) is None
    # the same prompt again: the boundary at 24 (the last full block before the last token)
    assert kv.get_computed_blocks(_request("c", tokens))[1] == 24


def test_a_boundary_saved_once_and_slots_replaced_least_recently_used():
    kv = _manager(slots=2)
    tokens = list(range(200, 240))
    a = _request("a", tokens[:17])
    assert [t for t, _ in _run(kv, a, [17])[0]] == [8, 16]
    twin = _request("twin", tokens[:17])  # same prefix, computed anyway (say, concurrently)
    kv.begin_step()
    kv.allocate_slots(twin, 17)
    assert kv.plan_state_saves(twin, 0, 17) == []  # saved already: nothing to save
    b = _request("b", tokens[:33])
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 16
    kv.begin_step()
    restored = kv.state_restore(b, num_hit)
    kv.allocate_slots(b, 17, hits)
    b.num_computed_tokens = num_hit
    # the step that resumes from a slot cannot also overwrite it: the other slot (boundary 8)
    # takes 24, and 32 finds none free
    saves = kv.plan_state_saves(b, 16, 17)
    assert [t for t, _ in saves] == [8] and saves[0][1] != restored
    assert kv.checkpoints.find(a.block_hashes[1]) is None  # boundary 8 was replaced
    assert kv.get_computed_blocks(_request("c", tokens[:10]))[1] == 0


def test_a_failed_step_forgets_its_saves_and_reset_forgets_all():
    kv = _manager()
    tokens = list(range(300, 320))
    a = _request("a", tokens)
    _run(kv, a, [20])
    assert len(kv.checkpoints) == 2
    kv.uncache("a")
    kv.free(a)
    assert len(kv.checkpoints) == 0
    b = _request("b", tokens)
    _run(kv, b, [20])
    kv.free(b)
    assert kv.get_computed_blocks(_request("c", tokens))[1] == 16
    assert kv.reset_prefix_cache() and len(kv.checkpoints) == 0


def test_no_caching_plans_nothing_and_settings_are_checked():
    kv = KVCacheManager(64, BLOCK, enable_caching=False,
                        checkpoints=StateCheckpoints(4, INTERVAL))
    assert kv.checkpoints is None and kv.plan_state_saves(_request("a", [5] * 20), 0, 20) == []
    config = EngineConfig.from_kwargs(block_size=16)
    assert config.state_checkpoint_interval == 256
    assert config.state_checkpoint_slots == config.scheduler.max_num_seqs
    assert EngineConfig.from_kwargs(block_size=512).state_checkpoint_interval == 512
    assert EngineConfig.from_kwargs(enable_prefix_caching=False).state_checkpoint_slots == 0
    with pytest.raises(ValueError, match="mamba_block_size must be a positive multiple"):
        EngineConfig.from_kwargs(block_size=16, mamba_block_size=40)
    with pytest.raises(ValueError, match="state_checkpoints must be >= 0"):
        EngineConfig.from_kwargs(state_checkpoints=-1)


def test_states_larger_than_the_kv_budget_name_both_settings():
    from octavo.executor.base import blocks_in_budget

    assert blocks_in_budget(1000, [(100, 300)]) == 7  # the states come out of the budget
    with pytest.raises(ValueError, match="max_num_seqs and per state_checkpoints"):
        blocks_in_budget(1000, [(100, 1200)])
