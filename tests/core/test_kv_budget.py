"""The automatic KV cache size: one full-length request (at least 1 GiB) within a share of the
memory left after the weights; the context cut to fit where that share is too small; an
explicit budget used as given."""
from __future__ import annotations

import logging

import pytest

from octavo.config import EngineConfig
from octavo.core.engine_core import EngineCore
from octavo.core.kv_budget import DEFAULT_KV_BYTES, plan_kv
from tests.core.test_engine_core import FakeExecutor

GiB = 1 << 30


class SizedExecutor(FakeExecutor):
    """Reports its block size and the memory left, and allocates what it is asked for."""

    def __init__(self, bytes_per_block: int, available: int | None) -> None:
        super().__init__(0)
        self.bytes_per_block = bytes_per_block
        self.available = available

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.bytes_per_block

    def available_memory(self) -> int | None:
        return self.available

    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        self.num_blocks = kv_cache_memory // self.bytes_per_block
        return super().init_kv_cache(kv_cache_memory, block_size)


def _core(max_model_len: int, bytes_per_block: int, available: int | None, **options):
    config = EngineConfig.from_kwargs(block_size=16, **options)
    executor = SizedExecutor(bytes_per_block, available)
    return EngineCore(config, executor, max_model_len), executor


def test_a_long_context_gets_the_memory_one_request_needs():
    # 32,768 tokens at 36 KiB a token: 1.125 GiB, past the old fixed 1 GiB
    core, ex = _core(32768, 16 * 36 << 10, available=20 * GiB)
    assert core.max_model_len == 32768
    assert ex.init_calls[0][0] == 32768 // 16 * (16 * 36 << 10)
    assert core.num_blocks * 16 >= 32768


def test_a_small_model_keeps_the_old_default():
    core, ex = _core(2048, 16 * 1024, available=20 * GiB)
    assert ex.init_calls[0][0] == DEFAULT_KV_BYTES and core.max_model_len == 2048


def test_too_little_memory_cuts_the_context_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        core, ex = _core(32768, 16 << 20, available=4 * GiB)  # 1 MiB a token; half: 2 GiB
    assert core.max_model_len == 2048 and ex.init_calls[0][0] == 2 * GiB
    assert "max_model_len cut from 32768 to 2048" in caplog.text
    assert core.scheduler.max_model_len == 2048


def test_an_explicit_budget_is_used_as_given_and_still_refused_when_too_small():
    core, ex = _core(2048, 16 * 1024, available=20 * GiB, kv_cache_memory=5 * 2**20)
    assert ex.init_calls[0][0] == 5 * 2**20
    with pytest.raises(ValueError, match="raise kv_cache_memory or lower max_model_len"):
        _core(32768, 16 << 20, available=4 * GiB, kv_cache_memory=GiB)


def test_unknown_memory_takes_the_default_and_sliding_windows_count_their_window():
    assert plan_kv(None, 0.5, 1024, 16, 8192, lambda n: n, None).kv_cache_memory == \
        DEFAULT_KV_BYTES
    # A window of 1,000 tokens: a request holds at most about that, whatever its context.
    plan = plan_kv(None, 0.5, 16 << 20, 16, 100000, lambda n: min(n, 1000), 4 * GiB)
    assert plan.max_model_len == 100000 and plan.kv_cache_memory >= 63 * (16 << 20)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig.from_kwargs(kv_cache_memory_fraction=0)
