"""The README's first command on a fresh virtual environment: `pip install` compiles the C++
kernels, so that the first start loads them without a build."""
from __future__ import annotations

import os
import re
import subprocess
import venv
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _readme_install_command() -> str:
    """The README's first set-up command, up to where it starts the server."""
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    first = blocks[0].strip()
    assert first.endswith("&& octavo serve"), first
    return first[: -len("&& octavo serve")].strip()


@pytest.mark.slow
def test_the_readme_install_builds_the_kernels(tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python3"
    command = _readme_install_command().replace("python3 ", f"{python} ")
    env = dict(os.environ, OCTAVO_CACHE=str(tmp_path / "cache"))  # so that it really compiles
    env.pop("PYTHONPATH", None)
    done = subprocess.run(command, shell=True, cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=1500)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    check = subprocess.run(
        [str(python), "-c", "import logging; logging.basicConfig(level=logging.INFO)\n"
         "from octavo.kernels import native\n"
         "assert native.cached_library() is not None, 'no build after the install'\n"
         "assert native.load(block=False) is not None\n"
         "import torch\n"
         "print(native.cached_library(), torch.__file__)"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert check.returncode == 0, check.stdout + check.stderr
    library, torch_file = check.stdout.split()
    assert library.startswith(str(tmp_path / "cache"))
    assert torch_file.startswith(str(env_dir))  # built and loaded against the venv's own torch
    assert "loaded in" in check.stderr and "building" not in check.stderr
