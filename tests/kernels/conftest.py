"""The C++ kernels must load wherever the tests run (CI has a compiler); each test that flips
the kernel choice puts it back afterwards."""
from __future__ import annotations

import pytest

from octavo.kernels import fused, native


@pytest.fixture
def native_kernels():
    if not native.enabled_by_env():
        pytest.skip("OCTAVO_NATIVE_KERNELS=0")
    was_on = fused._native is not None
    if not fused.enable_native(True):
        pytest.fail("the C++ kernels failed to build or load; see the log")
    yield
    fused.enable_native(was_on)
