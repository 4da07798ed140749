"""The kernels' build beside a serving engine: at idle priority, in a process group that dies
with the engine, started clean and loaded when done; a build that failed is not retried by every
start."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from octavo.kernels import native


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def _build_children(parent: int) -> list[int]:
    """Pids of the `octavo.kernels.build` children of `parent`."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == parent and b"octavo.kernels.build" in cmd:
            found.append(int(entry))
    return found


@pytest.fixture
def scratch_cache(tmp_path, monkeypatch):
    """An empty kernel cache, so that a build really compiles, and no module loaded yet."""
    monkeypatch.setenv("OCTAVO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_state", {})
    return tmp_path / "cache"


def test_a_build_beside_the_engine_runs_at_idle_priority_then_serves(scratch_cache, caplog):
    # What a build killed mid-compile leaves: an object and cpp_extension's lock. The build
    # starts clean rather than link what ninja might take for done.
    key_dir = scratch_cache / "kernels" / native._build_key()
    key_dir.mkdir(parents=True)
    (key_dir / "cpu_ops.o").write_bytes(b"half an object")
    (key_dir / "lock").write_text("")
    ready = threading.Event()
    loaded = []
    with caplog.at_level(logging.INFO):
        assert native.load(block=False, on_ready=lambda m: (loaded.append(m), ready.set())) \
            is None
        (child,) = _wait_for(lambda: _build_children(os.getpid()), 30, "the build's child")
        _wait_for(lambda: os.sched_getscheduler(child) == os.SCHED_IDLE, 30, "SCHED_IDLE")
        assert os.getpriority(os.PRIO_PROCESS, child) == 19
        assert os.getpgid(child) == child  # its compiler can be stopped with it
        assert ready.wait(900), "the background build did not finish"
    assert native.cached_library() is not None
    assert native.load(block=False) is loaded[0]  # the engine now has the kernels
    assert hasattr(loaded[0], "rms_norm")
    assert (key_dir / "cpu_ops.o").read_bytes() != b"half an object"
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "idle priority" in messages and "octavo build-kernels" in messages
    assert "switching to them" in messages


def test_the_engine_dying_takes_its_build_and_compiler_down(tmp_path):
    engine = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import time
        from octavo.kernels import native
        native.load(block=False)
        time.sleep(600)
        """)], env=dict(os.environ, OCTAVO_CACHE=str(tmp_path / "cache")))
    try:
        (child,) = _wait_for(lambda: _build_children(engine.pid), 60, "the build's child")
        # Wait until the compiler runs: it is what a SIGKILL of the child alone would orphan.
        _wait_for(lambda: any(_pgid_of(p) == child for p in _all_pids() if p != child), 120,
                  "the compiler")
        engine.send_signal(signal.SIGKILL)
        engine.wait()
        _wait_for(lambda: not _group_alive(child), 30, "the build's group to end")
    finally:
        if engine.poll() is None:
            engine.kill()
    assert not list((tmp_path / "cache" / "kernels").glob("*/ready"))


def _all_pids() -> list[int]:
    return [int(e) for e in os.listdir("/proc") if e.isdigit()]


def _pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_a_build_that_failed_is_not_retried_by_a_start(scratch_cache, caplog):
    key_dir = scratch_cache / "kernels" / native._build_key()
    key_dir.mkdir(parents=True)
    (key_dir / "failed").write_text("CalledProcessError: g++: not found")
    with caplog.at_level(logging.WARNING):
        assert native.load(block=False) is None
    assert _build_children(os.getpid()) == []
    (message,) = [r.getMessage() for r in caplog.records if "build failed" in r.getMessage()]
    assert "g++: not found" in message and "octavo build-kernels" in message


@pytest.mark.parametrize("march", ["sapphirerapids", "skylake-avx512", "znver2", "x86-64"])
def test_the_kernels_compile_for_every_cpu_kind(march, tmp_path):
    """The kernels are built with -march=native, so a machine compiles only its own ISA's
    branches: a session on an AVX2 CPU once left code that broke the build on every CPU with
    AVX-512 VNNI. Each family the project meets (AMX with AVX-512 BF16/VNNI; AVX-512 without
    them; AVX2; a baseline x86-64) is checked here by a syntax-only compile of every translation
    unit, in one file that includes them all (torch's headers, most of the time, parsed once)."""
    from torch.utils import cpp_extension

    assert len(native._SOURCES) > 1
    every_unit = tmp_path / "every_unit.cpp"
    every_unit.write_text("".join(f'#include "{source}"\n' for source in native._SOURCES))
    includes = [f"-I{path}" for path in cpp_extension.include_paths()]
    cmd = [cpp_extension.get_cxx_compiler(), "-std=c++17", "-fsyntax-only", "-w", "-O3",
           "-fopenmp", "-fno-math-errno", f"-march={march}", *includes, str(every_unit)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [line for line in done.stderr.splitlines() if "error" in line]
    assert done.returncode == 0, errors[:5] or done.stderr[-2000:]
