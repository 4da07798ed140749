"""A script that starts engine core processes and simply ends, never calling shutdown, exits
at once and leaves no core behind. The cores leave SIGTERM to their front end, so
multiprocessing's exit hook (terminate its daemon children, then join them) would wait on them
forever: the front end's own exit hook (core_replica.CoreStopper) must stop them first."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

OFFLINE_DP = """
from octavo import LLM, SamplingParams
llm = LLM(MODEL, dtype='float32', max_model_len=256, kv_cache_memory=32 << 20,
          data_parallel_size=2)
llm.generate(['Hello', 'The sky is'], SamplingParams(max_tokens=2), use_tqdm=False)
pids = [r.process.pid for r in llm.engine.client.replicas]
"""

ASYNC_LLM = """
import asyncio
from octavo import SamplingParams
from octavo.async_llm import AsyncLLM
llm = AsyncLLM(MODEL, dtype='float32', max_model_len=256, kv_cache_memory=32 << 20)

async def one():
    async for _ in llm.generate('Hello', SamplingParams(max_tokens=2), 'r1'):
        pass

asyncio.run(one())
pids = [r.process.pid for r in llm.engine.replicas]
"""


@pytest.mark.parametrize("body", [OFFLINE_DP, ASYNC_LLM], ids=["llm-data-parallel", "async-llm"])
def test_a_script_that_never_shuts_down_exits_and_leaves_no_core(body, smollm_gguf, tmp_path):
    script = tmp_path / "ends.py"
    script.write_text(f"MODEL = {str(smollm_gguf)!r}\n{body}\nprint(*pids, flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(pid) for pid in done.stdout.split()]
    assert pids
    for pid in pids:
        assert not _alive(pid), f"engine core {pid} outlived its script"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
