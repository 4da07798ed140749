"""Shared fixtures: the real catalog model and its transformers oracle, fetched once and cached."""
from __future__ import annotations

import os

import pytest

from octavo.model_source import cache_dir

# Inductor's own caches (its precompiled headers above all, slow to make) shared by every
# test that compiles layers, including those that keep their graphs in a folder of their own.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "compile" / "inductor"))


@pytest.fixture(scope="session")
def smollm_gguf():
    from octavo.model_source import pull

    return pull("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm_oracle_folder():
    from tests.oracle import oracle_folder

    return oracle_folder("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm_llm(smollm_gguf):
    """One float32 engine on SmolLM2 shared by the tests that only read from it."""
    from octavo import LLM

    return LLM(str(smollm_gguf), dtype="float32", max_model_len=2048, max_num_seqs=16,
               kv_cache_memory=256 << 20)


@pytest.fixture
def native_kernels():
    """The C++ kernels must load wherever the tests run (CI has a compiler); a test that flips
    the kernel choice gets it put back afterwards."""
    from octavo.kernels import fused

    was_on = fused._native is not None
    if not fused.enable_native(True):
        pytest.fail("the C++ kernels failed to build or load; see the log")
    yield
    fused.enable_native(was_on)
