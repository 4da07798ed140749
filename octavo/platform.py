"""What this machine's CPU can do, read once per process: its feature flags (for the kernels'
build key and the peers' settings), its ISA family, and the dtype `--dtype auto` means on it.

Every decision that depends on the CPU asks `cpu_platform()`, so that they cannot disagree.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags as the kernel lists them (empty where they cannot be read)."""
    try:
        with open(cpuinfo) as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


@dataclass(frozen=True)
class CpuPlatform:
    flags: frozenset[str]

    @property
    def amx(self) -> bool:
        """AMX tiles with bf16: oneDNN's bf16 GEMM runs on them."""
        return {"amx_tile", "amx_bf16"} <= self.flags

    @property
    def native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def isa(self) -> str:
        """The family octavo's kernels are compiled for: amx, avx512, avx2 or baseline."""
        if self.amx:
            return "amx"
        if "avx512f" in self.flags:
            return "avx512"
        return "avx2" if {"avx2", "fma"} <= self.flags else "baseline"

    def auto_dtype(self) -> tuple[str, str]:
        """What `--dtype auto` is on this CPU, and why."""
        if self.native_bf16:
            return "bfloat16", f"{self.isa} computes bf16 natively"
        return "float32", (f"{self.isa} has no native bf16: bf16 GEMMs would be emulated, "
                           "slower than float32 (docs/performance.md)")

    def key(self) -> str:
        """The flags as one sorted string (part of the kernels' build key)."""
        return " ".join(sorted(self.flags))


@functools.cache
def cpu_platform() -> CpuPlatform:
    return CpuPlatform(read_cpu_flags())
