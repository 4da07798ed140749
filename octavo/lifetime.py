"""Child processes that die with their parent: the engine core and a kernel build beside a
serving engine must never outlive the process that started them."""
from __future__ import annotations

import ctypes
import logging
import signal
import sys

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Send this process `sig` (SIGKILL: nothing to clean up) when its parent exits, however
    the parent dies (SIGKILL and the OOM killer included); False where the kernel cannot do it
    (not Linux), so that the caller checks its parent itself. Linux ties the signal to the
    parent *thread*: the parent must start this child from a thread that lives as long as the
    child should, and the child check that its parent did not die before this call."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
