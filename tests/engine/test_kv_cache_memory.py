"""The CPU KV cache is allocated lazily and in small pages (octavo/worker/memory.py `zeros`)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

from octavo.worker.memory import zeros


def _mapping_flags(address: int) -> list[str]:
    lines = open("/proc/self/smaps").read().splitlines()
    for i, line in enumerate(lines):
        head = line.split()[0]
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            start, end = (int(x, 16) for x in head.split("-"))
            if start <= address < end:
                flags = next(x for x in lines[i + 1:] if x.startswith("VmFlags:"))
                return flags.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self")
def test_the_kv_cache_is_zeros_mapped_lazily_without_huge_pages():
    """128 MB of cache: all zeros, writable, nearly nothing resident until written, and not marked
    for transparent huge pages (numpy's calloc marked it: each first write into a 2 MB stretch
    then zeroed 2 MB, and a first one-token request took 140 ms instead of 14)."""
    before = _rss()
    cache = zeros((2, 8192, 16, 4, 64), torch.bfloat16, torch.device("cpu"))
    assert cache.shape == (2, 8192, 16, 4, 64) and cache.dtype == torch.bfloat16
    assert _rss() - before < 16 << 20
    assert "hg" not in _mapping_flags(cache.data_ptr() + cache.nbytes // 2)
    cache[1, 17, 3] = 1.5
    assert _rss() - before < 16 << 20  # one written page, not a huge one
    assert cache[1, 17, 3].eq(1.5).all() and cache[1, 16:19].count_nonzero() == 4 * 64
    assert cache[0, :64].count_nonzero() == 0 and cache[1, -64:].count_nonzero() == 0


def test_a_kv_budget_beyond_free_memory_is_refused_at_start(smollm_gguf, monkeypatch):
    """10 TB of KV cache: refused with what was asked, what is free and the flag to change,
    before any of it is mapped (a lazy mapping would only be OOM-killed once written, and the
    core's block pool for it takes minutes)."""
    from octavo import LLM
    from octavo.worker import memory

    monkeypatch.setattr(memory, "zeros", lambda *a: pytest.fail("the cache was allocated"))
    with pytest.raises(ValueError) as err:
        LLM(str(smollm_gguf), kv_cache_memory=10 << 40, dtype="float32", max_model_len=256)
    message = str(err.value)
    assert "10,240.00 GiB" in message and "--kv-cache-memory" in message, message
    assert "available" in message and "MemAvailable" in message, message


def test_a_kv_budget_up_to_all_free_memory_is_allowed(monkeypatch):
    from octavo.worker import memory

    cpu = torch.device("cpu")
    free = memory.available_memory(cpu)
    assert free is not None and 0 < free[0] <= os.sysconf("SC_PHYS_PAGES") * os.sysconf(
        "SC_PAGE_SIZE")
    monkeypatch.setattr(memory, "available_memory", lambda device: (1 << 30, "test"))
    memory.check_kv_fits(1 << 30, cpu)  # all of it: fine
    with pytest.raises(ValueError, match=r"1\.00 GiB \(1073741825 bytes\) asked .* only 1\.00 "
                                         r"GiB \(1073741824 bytes\) is available \(test"):
        memory.check_kv_fits((1 << 30) + 1, cpu)


def test_gemma3_starts_with_its_whole_context_and_no_kv_argument(caplog):
    """Gemma 3 270M's 32,768-token context needs more than the old fixed 1 GiB of KV cache:
    with no budget given, the cache is sized for one full-length request."""
    import logging

    from octavo import LLM, SamplingParams
    from octavo.model_source import pull

    with caplog.at_level(logging.INFO):
        llm = LLM(str(pull("gemma3-270m")))
    try:
        assert llm.engine.setup.max_model_len == 32768
        assert llm.engine.processor.max_model_len == 32768
        core = llm.engine.client.core
        assert core.num_blocks * 16 >= 32768
        assert "memory plan: KV cache" in caplog.text
        out = llm.generate("The capital of France is", SamplingParams(max_tokens=3,
                                                                     temperature=0))
        assert len(out[0].outputs[0].token_ids) == 3
    finally:
        llm.engine.shutdown()
