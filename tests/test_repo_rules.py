"""Repository rules that run with the tests: import layers and file sizes."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_import_layers():
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.fail("lint-imports (import-linter) is not installed; install octavo[test]")
    done = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:]


def test_file_sizes():
    too_big = {str(p.relative_to(ROOT)): n for p in (ROOT / "octavo").rglob("*.py")
               if (n := len(p.read_text().splitlines())) > 800}
    assert not too_big, f"files over 800 lines: {too_big}"
    models = {str(p.relative_to(ROOT)): n for p in (ROOT / "octavo/model/models").glob("*.py")
              if (n := len(p.read_text().splitlines())) > 300}
    assert not models, f"model files over 300 lines: {models}"
