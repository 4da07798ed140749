"""`octavo collect-env`: runs without torch until its torch section, names the CPU, and a
missing piece is reported in its place."""
from __future__ import annotations

import subprocess
import sys


def test_collect_env_names_the_cpu_and_its_isa():
    done = subprocess.run([sys.executable, "-m", "octavo.entrypoints.cli.main", "collect-env"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    with open("/proc/cpuinfo") as f:
        model = next(line.split(":", 1)[1].strip() for line in f
                     if line.startswith("model name"))
    assert f"model: {model}" in out
    flags = open("/proc/cpuinfo").read()
    if " avx2" in flags:
        assert "avx2" in [line for line in out.splitlines() if line.startswith("ISA:")][0]
    for section in ("== PyTorch ==", "== Native kernels ==", "== Packages ==",
                    "== Compiler ==", "== Environment variables =="):
        assert section in out
    assert "torch: " in out and "xgrammar: " in out and "tokenizers: " in out


def test_sections_before_torch_do_not_import_it_and_faults_are_reported(monkeypatch):
    from octavo.entrypoints.cli import collect_env

    code = ("import sys; from octavo.entrypoints.cli import collect_env as c; "
            "c._cpu(); c._packages(); c._system(); c._memory(); c._environment(); "
            "assert 'torch' not in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr

    def broken():
        raise OSError("no such file")

    assert collect_env._safely(broken) == [("unavailable", "OSError: no such file")]
    monkeypatch.setenv("OCTAVO_API_KEY", "s3cret")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    rows = dict(collect_env._environment())
    assert rows["OCTAVO_API_KEY"] == "<redacted>" and rows["OMP_NUM_THREADS"] == "2"
