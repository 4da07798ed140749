"""The CPU platform (octavo/platform.py): each CPU kind octavo meets, read from its cpuinfo, gets
its ISA family, AMX and native-bf16 answers and the dtype `--dtype auto` means there; the worker
logs that choice with its reason."""
from __future__ import annotations

import logging

import pytest
import torch

from octavo.platform import CpuPlatform, cpu_platform, read_cpu_flags
from octavo.worker.worker import resolve_dtype

KINDS = {  # the three CPUs seen here, trimmed to the flags that matter
    "xeon-amx": ("fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_tile amx_int8", "amx", True,
                 "bfloat16"),
    "epyc-avx512": ("fpu avx2 fma avx512f avx512_vnni avx512_bf16", "avx512", False, "bfloat16"),
    "epyc-avx2": ("fpu avx2 fma f16c", "avx2", False, "float32"),
    "old": ("fpu sse4_2", "baseline", False, "float32"),
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_cpu_kind(kind, tmp_path):
    flags, isa, amx, dtype = KINDS[kind]
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    platform = CpuPlatform(read_cpu_flags(str(info)))
    assert (platform.isa, platform.amx) == (isa, amx)
    assert platform.auto_dtype()[0] == dtype
    assert isa in platform.auto_dtype()[1]
    assert platform.key() == " ".join(sorted(flags.split()))


def test_unreadable_cpuinfo_is_a_baseline_cpu(tmp_path):
    platform = CpuPlatform(read_cpu_flags(str(tmp_path / "missing")))
    assert platform.flags == frozenset() and platform.isa == "baseline"
    assert platform.auto_dtype()[0] == "float32"


def test_auto_follows_the_platform_and_an_explicit_dtype_wins():
    cpu = torch.device("cpu")
    assert resolve_dtype("auto", cpu)[0] == getattr(torch, cpu_platform().auto_dtype()[0])
    assert resolve_dtype("float32", cpu) == (torch.float32, "asked for")
    assert resolve_dtype("bfloat16", cpu) == (torch.bfloat16, "asked for")


def test_the_start_logs_the_dtype_and_why(smollm_gguf, caplog):
    from octavo import LLM

    with caplog.at_level(logging.INFO, logger="octavo.worker.worker"):
        llm = LLM(str(smollm_gguf), max_model_len=64, kv_cache_memory=8 << 20)
    llm.engine.shutdown()
    name, why = cpu_platform().auto_dtype()
    assert f"dtype {name}: {why}" in caplog.text
