"""octavo's C++ CPU kernels (csrc/*.cpp and the headers they include), compiled once per
machine and cached on disk, and registered with PyTorch's dispatcher as `torch.ops.octavo.*` and
`torch.classes.octavo.DecodeStack` (so the profiler names them; with their output shapes
registered here, torch.compile can trace calls to them).

`pip install` builds them (setup.py runs `octavo.kernels.build` against the installing
environment's torch), as does `octavo build-kernels`; a start then loads the cached library in
well under a second. The build uses the system C++ compiler through `torch.utils.cpp_extension`
(about 30-95 s on two cores). A server that finds no build serves with the PyTorch ops and builds
in a child process at idle priority (`build.run_beside_engine`), so the compiler only has the
cycles the engine leaves; without a compiler the engine runs the PyTorch ops and says so.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from octavo.disk_cache import describe, make_dirs, write_text
from octavo.platform import cpu_platform

logger = logging.getLogger(__name__)

# The kernels (cpu_ops.cpp) and DecodeStack (decode_stack.cpp): two translation units, which
# ninja compiles in parallel on two cores.
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))  # part of the build key
_lock = threading.Lock()
_state: dict[str, Kernels | threading.Thread | None] = {}


def _cache_root() -> Path:
    base = os.environ.get("OCTAVO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "octavo")
    return Path(base) / "kernels"


def _build_key() -> str:
    """Source, torch version and CPU flags: a library built elsewhere is never reused here."""
    import torch

    h = hashlib.sha256()
    for source in (*_SOURCES, *_HEADERS):
        h.update(source.name.encode() + source.read_bytes())
    h.update(torch.__version__.encode())
    h.update(cpu_platform().key().encode())
    return h.hexdigest()[:16]


def load(block: bool = True,
         on_ready: Callable[[Kernels], None] | None = None) -> Kernels | None:
    """The compiled module, building it on first use; None (with the reason logged) when it
    cannot be had. With block=False and no cached build, a build starts in a child process at
    idle priority, None is returned now and `on_ready` gets the module when it is loaded."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        if block or _is_cached():
            _state["module"] = build()
            return _state["module"]  # type: ignore[return-value]
        if "thread" not in _state:
            _state["thread"] = _start_build_beside_engine(on_ready)  # type: ignore[assignment]
        return None


def _start_build_beside_engine(on_ready: Callable[[Kernels], None] | None
                               ) -> threading.Thread | None:
    failure = last_failure()
    if failure is not None:
        logger.warning("native CPU kernels unavailable: their build failed on this machine (%s); "
                       "using PyTorch ops, decode is slower. `octavo build-kernels` builds them "
                       "again", failure)
        return None
    logger.warning("native CPU kernels are not built for this machine (`pip install` builds "
                   "them; so does `octavo build-kernels`); PyTorch ops serve while they build in "
                   "the background at idle priority")
    # The waiting thread starts the child: Linux ties the child's death signal to it.
    thread = threading.Thread(target=_build_beside_engine, args=(on_ready,),
                              name="octavo-kernel-build", daemon=True)
    thread.start()
    return thread


def _build_beside_engine(on_ready: Callable[[Kernels], None] | None) -> None:
    from octavo.kernels import build

    start = time.perf_counter()
    if build.run_beside_engine() != 0 or not _is_cached():
        logger.warning("native CPU kernels unavailable (%s); using PyTorch ops, decode is slower",
                       last_failure() or "the build did not finish")
        return
    module = _load_built(_build_key(), _library(_build_key()))
    logger.info("native CPU kernels built beside the engine in %.1f s; switching to them",
                time.perf_counter() - start)
    with _lock:
        _state["module"] = module
    if on_ready is not None:
        on_ready(module)


_READY = "ready"  # written after a build loads: a library left by an interrupted build is no cache
_FAILED = "failed"  # why the last build here failed; a start does not retry it by itself
_LOCK = "octavo.lock"


def _library(key: str) -> Path:
    return _cache_root() / key / f"octavo_cpu_ops_{key}.so"


def _is_cached() -> bool:
    return (_cache_root() / _build_key() / _READY).is_file()


def last_failure() -> str | None:
    """Why the last build of these kernels on this machine failed, if it did."""
    try:
        return (_cache_root() / _build_key() / _FAILED).read_text().strip() or "unknown error"
    except OSError:
        return None


def cached_library() -> Path | None:
    """The built library for this source, torch and CPU, if there is one."""
    return _library(_build_key()) if _is_cached() else None


class Kernels:
    """A loaded build: each op of `torch.ops.octavo` as an attribute (its one overload, which
    skips the overload lookup of every call), what the build computes natively, and the
    DecodeStack class."""

    _OPS = ("write_kv", "decode_attention", "rms_norm", "one_plus_rms_norm", "rotary_inplace",
            "silu_and_mul", "gelu_tanh_and_mul", "int8_gemv", "int4_gemm", "int4_int8_gemm",
            "int4_int16_gemm",
            "int4_dequantize", "int4_tiled_linear", "int4_rows", "int8_dequantize",
            "int8_tiled_linear", "lora_apply", "microscaled_gemv", "microscaled_dequantize",
            "microscaled_tiled_linear", "delta_rule_step")

    def __init__(self) -> None:
        import torch

        ops = torch.ops.octavo
        for name in self._OPS:
            setattr(self, name, getattr(ops, name).default)
        features = set(ops.features())
        self.has_int4_gemm = "int4_gemm_bf16" in features
        self.has_int4_gemm_f32 = "int4_gemm_f32" in features
        self.has_prompt_runs = "prompt_runs" in features
        self.has_int4_int8_gemm = "int4_int8_gemm" in features  # bf16 activations
        self.has_int4_int8_gemm_f32 = "int4_int8_gemm_f32" in features
        self.has_int4_int16_gemm = "int4_int16_gemm" in features
        self.DecodeStack = torch.classes.octavo.DecodeStack


# The build each key loaded in this process. A library registers the `octavo` op namespace when
# it is opened, once per process: a build of the same key found elsewhere (another cache
# folder) is the same code and is not opened again, and one of another key cannot be.
_opened: dict[str, Kernels] = {}


def _register_fakes() -> None:
    """Each op's output shape without running it (torch.library.register_fake), so that
    torch.compile and FakeTensor tracing can take graphs that call octavo's kernels."""
    import torch

    def rows_out(x, weight_rows):
        return x.new_empty(x.shape[0], weight_rows)

    fakes = {
        "rms_norm": lambda x, weight, eps: torch.empty_like(x),
        "one_plus_rms_norm": lambda x, plus_one, eps: torch.empty_like(x),
        "silu_and_mul": lambda x: x.new_empty(x.shape[0], x.shape[1] // 2),
        "gelu_tanh_and_mul": lambda x: x.new_empty(x.shape[0], x.shape[1] // 2),
        "write_kv": lambda k, v, k_cache, v_cache, slot_mapping: None,
        "decode_attention": lambda *args: None,
        "rotary_inplace": lambda x, positions, cos, sin: None,
        "int8_gemv": lambda x, q, scale: rows_out(x, q.shape[0]),
        "int4_gemm": lambda x, codes, scales, high_bits=None: rows_out(x, codes.shape[0] * 16),
        "int4_int8_gemm": lambda x, codes, scales, high_bits=None: rows_out(
            x, codes.shape[0] * 16),
        "int4_int16_gemm": lambda x, codes, scales, high_bits=None: rows_out(
            x, codes.shape[0] * 16),
        "int4_tiled_linear": lambda x, codes, scales, high_bits=None: rows_out(
            x, codes.shape[0] * 16),
        "int8_tiled_linear": lambda x, q, scale: rows_out(x, q.shape[0]),
        "lora_apply": lambda *args: None,
        "delta_rule_step": lambda state, rows, q, k, v, beta, g: torch.empty_like(v),
        "microscaled_gemv": lambda x, codes, scales, code_lut, scale_lut, block: rows_out(
            x, codes.shape[0]),
        "microscaled_tiled_linear": lambda x, codes, scales, code_lut, scale_lut, block:
        rows_out(x, codes.shape[0]),
        "microscaled_dequantize": lambda codes, scales, code_lut, scale_lut, block, first, count:
        codes.new_empty(count, scales.shape[1] * block, dtype=torch.float32),
        "int8_dequantize": lambda q, scale, first, count, bf16: q.new_empty(
            count, q.shape[1], dtype=torch.bfloat16 if bf16 else torch.float32),
        "int4_dequantize": lambda codes, scales, high_bits, first_block, blocks, bf16:
        codes.new_empty(16 * blocks, codes.shape[1] * 4,
                        dtype=torch.bfloat16 if bf16 else torch.float32),
        "int4_rows": lambda codes, scales, high_bits, ids, bf16: codes.new_empty(
            ids.shape[0], codes.shape[1] * 4, dtype=torch.bfloat16 if bf16 else torch.float32),
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"octavo::{name}", fake)


def _check_openable(key: str) -> None:
    if _opened and key not in _opened:
        raise RuntimeError(f"octavo's kernels {next(iter(_opened))} are already loaded in this "
                           f"process; a build of {key} (another source, torch or CPU) cannot be")


def _open_library(key: str, path: Path) -> Kernels:
    import torch

    _check_openable(key)
    if key not in _opened:
        torch.ops.load_library(str(path))
        _register_fakes()
        _opened[key] = Kernels()
    return _opened[key]


def build() -> Kernels | None:
    """Build (or load the cached build of) the kernels in this process, now."""
    key = _build_key()
    build_dir = _cache_root() / key
    library = _library(key)
    if (build_dir / _READY).is_file() and library.is_file():
        return _load_built(key, library)
    # One build per key at a time, under a lock the OS drops when its holder dies: a process
    # killed mid-build (a server stopped while its kernels built in the background) leaves
    # cpp_extension's own lock file behind, on which every later build would wait forever.
    try:
        make_dirs(build_dir)
        guard = open(build_dir / _LOCK, "w")
    except OSError as exc:  # a read-only or foreign cache without this build
        logger.warning("native CPU kernels unavailable (cannot build in %s: %s); using PyTorch "
                       "ops, decode is slower", build_dir, describe(exc))
        return None
    with guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        if (build_dir / _READY).is_file() and library.is_file():  # built while we waited
            return _load_built(key, library)
        # Not ready: what is there was left by a build that died (cpp_extension's lock, objects
        # that ninja might take for done); no live build holds it now.
        _remove_outputs(build_dir)
        return _compile(key, build_dir)


def _load_built(key: str, library: Path) -> Kernels:
    # The key already covers source, torch and CPU: open the library itself rather than let
    # cpp_extension import its build machinery and run ninja (0.2 s of a start).
    start = time.perf_counter()
    module = _open_library(key, library)
    logger.info("native CPU kernels loaded in %.2f s", time.perf_counter() - start)
    return module


def _compile(key: str, build_dir: Path) -> Kernels | None:
    _check_openable(key)  # before the build opens its library
    start = time.perf_counter()
    logger.info("building the native CPU kernels for this machine (once; `pip install` and "
                "`octavo build-kernels` do it ahead of a start)")
    from torch.utils import cpp_extension

    try:
        # Not a Python module: the library registers its ops with torch when opened, and
        # without torch/extension.h (pybind11) it compiles in a fraction of the time.
        cpp_extension.load(
            name=f"octavo_cpu_ops_{key}", sources=[str(source) for source in _SOURCES],
            build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno",
                          "-mprefer-vector-width=512"], extra_ldflags=["-fopenmp"],
            is_python_module=False, verbose=False)
    except Exception as exc:  # a missing compiler or headers, a full disk: fall back, loudly
        errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
        reason = f"{type(exc).__name__}: {' | '.join(errors[:3] or [str(exc)])[:600]}"
        logger.warning("native CPU kernels unavailable (%s); using PyTorch ops, decode is "
                       "slower", reason)
        _remove_outputs(build_dir)
        write_text(build_dir / _FAILED, reason, "the native kernels' failure note")
        return None
    logger.info("native CPU kernels built in %.1f s", time.perf_counter() - start)
    # Without the stamp (a full disk) the next start only checks the build again.
    write_text(build_dir / _READY, "", "the native kernels' ready stamp")
    (build_dir / _FAILED).unlink(missing_ok=True)
    return _open_library(key, _library(key))  # opened by the build: registered once


def _remove_outputs(build_dir: Path) -> None:
    """What a failed build left (objects, a half-linked library, ninja's files): never loaded,
    as no stamp names them ready, but on a full disk they hold the space it lacks. The lock
    stays: it is held (by this process) until the build returns."""
    with contextlib.suppress(OSError):
        for entry in build_dir.iterdir():
            if entry.name == _LOCK:
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
