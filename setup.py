"""octavo's build: the package itself (pyproject.toml), and its C++ CPU kernels compiled for this
machine during `pip install`, so that the first start loads them at once.

The kernels link against the torch that will run them, so they are built by the installing
environment's own interpreter and torch, not in pip's isolated build environment (which would
need a torch of its own: an unpinned, multi-GB download that need not match the one installed).
Without torch yet, or without a compiler, the install goes on and says so; a start then serves
with the PyTorch ops and `octavo build-kernels` builds the kernels.
"""
import os
import subprocess
import sys
from pathlib import Path

from setuptools import Command, setup
from setuptools.command.build import build

ROOT = Path(__file__).resolve().parent


def _installing_environment() -> dict:
    """The environment without pip's build isolation (its PYTHONPATH hides the installed
    packages, torch among them), importing octavo from this source tree."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONNOUSERSITE")}
    env["PYTHONPATH"] = str(ROOT)
    return env


class BuildKernels(Command):
    description = "compile octavo's C++ CPU kernels for this machine (never fails the install)"
    user_options: list = []
    editable_mode = False

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def get_outputs(self) -> list:
        return []  # the build lives in octavo's cache (~/.cache/octavo/kernels), not the wheel

    def get_output_mapping(self) -> dict:
        return {}

    def run(self) -> None:
        if os.environ.get("OCTAVO_SKIP_KERNEL_BUILD"):
            print("octavo: OCTAVO_SKIP_KERNEL_BUILD is set; not building the C++ kernels")
            return
        env = _installing_environment()
        has_torch = subprocess.run([sys.executable, "-c", "import torch"], env=env,
                                   capture_output=True).returncode == 0
        if not has_torch:
            print("octavo: torch is not installed yet, so the C++ kernels are not built now; "
                  "`octavo build-kernels` builds them (a start without them serves with "
                  "PyTorch ops)")
            return
        done = subprocess.run([sys.executable, "-m", "octavo.kernels.build"], env=env, cwd=ROOT)
        if done.returncode != 0:
            print("octavo: the C++ kernels could not be built (see above); octavo runs with "
                  "PyTorch ops, and `octavo build-kernels` tries again")


build.sub_commands.append(("build_kernels", None))
setup(cmdclass={"build_kernels": BuildKernels})
