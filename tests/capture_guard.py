"""The stand-in for CUDA graph capture on the CPU, for the tests of CUDA graphs
(tests/worker/test_decode_graphs.py says what it checks; tests/parity/test_lora.py uses it
too): import `rerun_capture` into a test module or conftest to use it."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from octavo.worker import decode_graphs

aten = torch.ops.aten
_HOST_READS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.bincount,
               aten.unique_consecutive, aten._unique2, aten.equal}


class HostReadGuard(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        packet = func.overloadpacket
        if packet in _HOST_READS:
            raise AssertionError(f"a captured step read the device's data on the host: {func}")
        if func is aten.repeat_interleave.Tensor and (kwargs or {}).get("output_size") is None:
            raise AssertionError(f"a captured step sized a tensor by its data: {func}")
        if packet in (aten.index, aten.index_put, aten.index_put_) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
                if i is not None):
            raise AssertionError(f"a captured step indexed by a boolean mask: {func}")
        return func(*args, **(kwargs or {}))


def _refused(*_args, **_kwargs):
    raise AssertionError("a captured step read a tensor on the host")


@pytest.fixture
def rerun_capture(monkeypatch):
    """The stand-in capture; returns a list with an entry per run of a step (capture or replay)."""
    calls = []

    def guarded(forward):
        with pytest.MonkeyPatch.context() as mp, HostReadGuard():
            for name in ("tolist", "numpy", "__array__"):
                mp.setattr(torch.Tensor, name, _refused)
            calls.append(1)
            return forward()

    def capture(forward):
        guarded(forward)
        return lambda: guarded(forward)

    monkeypatch.setattr(decode_graphs, "capturer", lambda device: capture)
    return calls
