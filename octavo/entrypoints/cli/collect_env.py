"""`octavo collect-env`: the environment, for bug reports (as vLLM's collect_env).

Package versions come from their metadata, so nothing heavy is imported until the torch
section, the last; each section that fails says why in its place and the rest still print.
Environment variables whose names look secret (keys, tokens, passwords) are shown redacted.
"""
from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib import metadata

PACKAGES = ("octavo", "torch", "transformers", "tokenizers", "xgrammar", "numpy", "gguf",
            "safetensors", "huggingface_hub", "fastapi", "uvicorn", "pyzmq", "msgspec",
            "jinja2", "opentelemetry-sdk")
# The instruction sets the kernels and torch's CPU paths care about.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw",
             "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile",
             "amx_bf16", "amx_int8", "asimd", "sve", "sve2")
ENV_PREFIXES = ("OMP_", "MKL_", "KMP_", "GOMP_", "OCTAVO_", "TORCH_", "ONEDNN_", "DNNL_",
                "HF_", "CUDA_", "OTEL_")
ENV_NAMES = ("LD_PRELOAD", "CXX", "CC", "TRANSFORMERS_OFFLINE")
_SECRET = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|CREDENTIAL|AUTH", re.IGNORECASE)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("collect-env", help="print the environment for a bug report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    print(collect())
    return 0


def collect() -> str:
    lines: list[str] = []
    for title, section in (("octavo", _octavo), ("System", _system), ("CPU", _cpu),
                           ("Memory", _memory), ("Packages", _packages),
                           ("Compiler", _compiler), ("Environment variables", _environment),
                           ("PyTorch", _torch), ("Native kernels", _native_kernels)):
        lines.append(f"== {title} ==")
        lines.extend(f"{key}: {value}" for key, value in _safely(section))
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


Rows = list[tuple[str, object]]


def _safely(section: Callable[[], Rows]) -> Rows:
    try:
        return section()
    except Exception as exc:  # a missing piece is reported, never fatal
        return [("unavailable", f"{type(exc).__name__}: {exc}")]


def _octavo() -> Rows:
    import octavo

    return [("version", octavo.__version__), ("location", os.path.dirname(octavo.__file__)),
            ("cache", os.environ.get("OCTAVO_CACHE")
             or os.path.join(os.path.expanduser("~"), ".cache", "octavo"))]


def _system() -> Rows:
    rows: Rows = [("Python", f"{platform.python_version()} ({sys.executable})"),
                  ("platform", platform.platform()), ("machine", platform.machine())]
    try:
        with open("/etc/os-release") as f:
            release = dict(line.rstrip("\n").split("=", 1) for line in f if "=" in line)
        rows.append(("OS", release.get("PRETTY_NAME", "?").strip('"')))
    except OSError:
        rows.append(("OS", f"{platform.system()} {platform.release()}"))
    libc = " ".join(platform.libc_ver())
    if libc.strip():
        rows.append(("libc", libc))
    return rows


def _cpuinfo() -> list[dict[str, str]]:
    """/proc/cpuinfo's processors as dicts (empty off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            blocks = f.read().strip().split("\n\n")
    except OSError:
        return []
    return [dict((k.strip(), v.strip()) for k, v in (line.split(":", 1) for line in block
                                                    .splitlines() if ":" in line))
            for block in blocks]


def _cpu() -> Rows:
    procs = _cpuinfo()
    first = procs[0] if procs else {}
    model = (first.get("model name") or first.get("Model") or first.get("Hardware")
             or platform.processor() or "unknown")
    rows: Rows = [("model", model)]
    physical = {(p.get("physical id"), p.get("core id")) for p in procs if "core id" in p}
    rows.append(("logical cores", os.cpu_count()))
    if physical:
        rows.append(("physical cores", len(physical)))
        rows.append(("sockets", len({socket for socket, _ in physical})))
    if hasattr(os, "sched_getaffinity"):
        rows.append(("cores this process may use", len(os.sched_getaffinity(0))))
    nodes = [n for n in _listdir("/sys/devices/system/node") if re.fullmatch(r"node\d+", n)]
    if nodes:
        rows.append(("NUMA nodes", len(nodes)))
    flags = set((first.get("flags") or first.get("Features") or "").split())
    if flags:
        rows.append(("ISA", " ".join(f for f in ISA_FLAGS if f in flags) or "none of note"))
        if platform.machine().lower() in ("x86_64", "amd64"):
            rows.append(("ISA missing", " ".join(f for f in ISA_FLAGS[:16] if f not in flags)
                         or "none"))
    return rows


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _memory() -> Rows:
    rows: Rows = []
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f if ":" in line)
        for key in ("MemTotal", "MemAvailable", "SwapTotal"):
            if key in info:
                rows.append((key, _gib(int(info[key].split()[0]) << 10)))
    except OSError:
        pass
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                limit = f.read().strip()
        except OSError:
            continue
        unlimited = limit == "max" or (limit.isdigit() and int(limit) >= 1 << 60)
        rows.append(("cgroup limit", "none" if unlimited
                     else _gib(int(limit)) if limit.isdigit() else limit))
        break
    return rows or [("memory", "unknown on this system")]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def _packages() -> Rows:
    rows: Rows = []
    for name in PACKAGES:
        try:
            rows.append((name, metadata.version(name)))
        except metadata.PackageNotFoundError:
            rows.append((name, "not installed"))
    return rows


def _compiler() -> Rows:
    rows: Rows = []
    for name in dict.fromkeys((os.environ.get("CXX", "c++"), "g++", "clang++")):
        path = shutil.which(name)
        if path is None:
            rows.append((name, "not found"))
            continue
        try:
            out = subprocess.run([path, "--version"], capture_output=True, text=True,
                                 timeout=10).stdout
            rows.append((name, (out.splitlines() or ["?"])[0]))
        except (OSError, subprocess.SubprocessError) as exc:
            rows.append((name, f"{path}: {exc}"))
    return rows


def _environment() -> Rows:
    rows = [(name, "<redacted>" if _SECRET.search(name) else value)
            for name, value in sorted(os.environ.items())
            if name.startswith(ENV_PREFIXES) or name in ENV_NAMES]
    return rows or [("(none set)", "no OMP_, MKL_, KMP_, OCTAVO_, TORCH_ or HF_ variables")]


def _torch() -> Rows:
    import torch

    rows: Rows = [("version", torch.__version__), ("debug build", torch.version.debug),
                  ("CPU capability", torch.backends.cpu.get_cpu_capability()),
                  ("threads", torch.get_num_threads()),
                  ("interop threads", torch.get_num_interop_threads()),
                  ("oneDNN (mkldnn)", torch.backends.mkldnn.is_available()),
                  ("MKL", torch.backends.mkl.is_available()),
                  ("OpenMP", torch.backends.openmp.is_available()),
                  ("CUDA built", torch.version.cuda or "no")]
    if torch.cuda.is_available():
        rows.append(("CUDA devices", ", ".join(torch.cuda.get_device_name(i)
                                               for i in range(torch.cuda.device_count()))))
    else:
        rows.append(("CUDA devices", "none"))
    return rows


def _native_kernels() -> Rows:
    from octavo.kernels import native

    library = native.cached_library()
    if library is not None:
        return [("built", "yes"), ("library", str(library))]
    failure = native.last_failure()
    return [("built", "no"), ("last build", f"failed: {failure}" if failure
                              else "none on this machine (`octavo build-kernels` builds them)")]
