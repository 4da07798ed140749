"""octavo's C++ CPU kernels (csrc/cpu_ops.cpp and the headers it includes), compiled once per
machine and cached on disk.

The build uses the system C++ compiler through `torch.utils.cpp_extension` and takes about
30 s on two cores; later starts load the cached library in well under a second. A server can
build in the background and serve with the PyTorch ops meanwhile. Without a compiler the engine
runs the PyTorch ops and says so in its log.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

from octavo.disk_cache import describe, make_dirs, write_text

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "cpu_ops.cpp"  # one translation unit: it includes
_HEADERS = sorted(_SOURCE.parent.glob("*.h"))  # the kernels' headers, part of the build key
_lock = threading.Lock()
_state: dict[str, ModuleType | str | None] = {}


def _cache_root() -> Path:
    base = os.environ.get("OCTAVO_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "octavo")
    return Path(base) / "kernels"


def _build_key() -> str:
    """Source, torch version and CPU flags: a library built elsewhere is never reused here."""
    import torch

    h = hashlib.sha256(_SOURCE.read_bytes())
    for header in _HEADERS:
        h.update(header.name.encode() + header.read_bytes())
    h.update(torch.__version__.encode())
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    h.update(flags.encode())
    return h.hexdigest()[:16]


def load(block: bool = True,
         on_ready: Callable[[ModuleType], None] | None = None) -> ModuleType | None:
    """The compiled module, building it on first use; None (with the reason logged) when it
    cannot be had. With block=False and no cached build, the build runs in a thread, None is
    returned now and `on_ready` gets the module when it is done."""
    with _lock:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        if block or _is_cached():
            _state["module"] = _build()
            return _state["module"]  # type: ignore[return-value]
        if "thread" not in _state:
            logger.info("building the native CPU kernels in the background; PyTorch ops serve "
                        "until they are ready")
            thread = threading.Thread(target=_build_in_background, args=(on_ready,),
                                      name="octavo-kernel-build", daemon=True)
            _state["thread"] = thread  # type: ignore[assignment]
            thread.start()
        return None


def _build_in_background(on_ready: Callable[[ModuleType], None] | None) -> None:
    module = _build()
    with _lock:
        _state["module"] = module
    if module is not None and on_ready is not None:
        on_ready(module)


_READY = "ready"  # written after a build loads: a library left by an interrupted build is no cache
_LOCK = "octavo.lock"


def _is_cached() -> bool:
    return (_cache_root() / _build_key() / _READY).is_file()


def _import_library(name: str, path: Path) -> ModuleType:
    import torch  # noqa: F401  (the library links against torch's, which must be loaded first)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build() -> ModuleType | None:
    key = _build_key()
    build_dir = _cache_root() / key
    library = build_dir / f"octavo_cpu_ops_{key}.so"
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
        (build_dir / "lock").unlink(missing_ok=True)  # no live build holds it now
        return _compile(key, build_dir)


def _load_built(key: str, library: Path) -> ModuleType:
    # The key already covers source, torch and CPU: import the library itself rather than let
    # cpp_extension import its build machinery and run ninja (0.2 s of a start).
    start = time.perf_counter()
    module = _import_library(f"octavo_cpu_ops_{key}", library)
    logger.info("native CPU kernels loaded in %.2f s", time.perf_counter() - start)
    return module


def _compile(key: str, build_dir: Path) -> ModuleType | None:
    start = time.perf_counter()
    from torch.utils import cpp_extension

    try:
        module = cpp_extension.load(
            name=f"octavo_cpu_ops_{key}", sources=[str(_SOURCE)], build_directory=str(build_dir),
            extra_cflags=["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-mprefer-vector-width=512"], extra_ldflags=["-fopenmp"],
            verbose=False)
    except Exception as exc:  # a missing compiler or headers, a full disk: fall back, loudly
        errors = [line for line in str(exc).splitlines() if "error" in line.lower()]
        logger.warning("native CPU kernels unavailable (%s: %s); using PyTorch ops, decode is "
                       "slower", type(exc).__name__, " | ".join(errors[:3] or [str(exc)])[:600])
        _remove_outputs(build_dir)
        return None
    logger.info("native CPU kernels built in %.1f s", time.perf_counter() - start)
    # Without the stamp (a full disk) the next start only checks the build again.
    write_text(build_dir / _READY, "", "the native kernels' ready stamp")
    return module


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
