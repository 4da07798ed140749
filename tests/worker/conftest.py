"""The CUDA graph tests' stand-in capture (tests/capture_guard.py)."""
from tests.capture_guard import rerun_capture  # noqa: F401
