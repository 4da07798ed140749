"""The mp executor on a tiny random Llama: one worker process (tp = pp = 1, forced) gives the
in-process executor's tokens and logprobs; a worker that dies or fails is a clear error within
seconds and leaves no process behind; shutdown returns whatever state the workers are in."""
from __future__ import annotations

import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest

from octavo import LLM, SamplingParams, StructuredOutputsParams
from octavo.core.contract import CachedRequestData, SchedulerOutput
from octavo.executor import multiproc
from octavo.executor.multiproc import MultiprocExecutor, WorkerFailed
from tests.executor.procs import children

_EARLIER: set[int] = set()


@pytest.fixture(autouse=True)
def _earlier_children():
    """Children other tests of this run left running (a server still exiting, a kernel build):
    not this test's leftovers."""
    _EARLIER.clear()
    _EARLIER.update(children())


def _children() -> set[int]:
    return children() - _EARLIER

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, num_threads=1,
          native_kernels="off", max_num_batched_tokens=32)  # prompts span several chunks
# Generous bounds on "within seconds" (a loaded 2-core machine), far below any hang.
FAILURE_BOUND_S = 15.0


def _mp(folder: Path, **kw) -> LLM:
    return LLM(str(folder), distributed_executor_backend="mp", **{**KW, **kw})


def _executor(llm: LLM) -> MultiprocExecutor:
    executor = llm.engine.client.core.executor
    assert isinstance(executor, MultiprocExecutor)
    return executor


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
            for i, n in enumerate((5, 40, 3, 70, 12))]


def test_one_worker_process_gives_the_in_process_tokens(tiny_llama):
    prompts = _prompts()
    params = [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3,
                             prompt_logprobs=2),
              SamplingParams(max_tokens=8, temperature=0.8, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0,
                             structured_outputs=StructuredOutputsParams(choice=["yes", "no"])),
              SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=2),
              SamplingParams(max_tokens=10, temperature=0, allowed_token_ids=[11, 12, 13])]
    ref = LLM(str(tiny_llama), **KW).generate(prompts, params, use_tqdm=False)
    llm = _mp(tiny_llama)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert "1 worker processes" in _executor(llm).describe()
    finally:
        llm.engine.shutdown()
    for a, b in zip(outs, ref):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
        for ca, cb in zip(a.outputs, b.outputs):
            if cb.logprobs:
                assert _logprobs(ca.logprobs) == pytest.approx(_logprobs(cb.logprobs), abs=1e-5)
        if b.prompt_logprobs:
            assert _logprobs(a.prompt_logprobs[1:]) == \
                pytest.approx(_logprobs(b.prompt_logprobs[1:]), abs=1e-5)
    assert outs[2].outputs[0].finish_reason == "stop"  # the grammar ended it
    assert _children() == set()


def _logprobs(positions) -> dict[tuple[int, int], float]:
    return {(i, t): lp.logprob for i, d in enumerate(positions) for t, lp in d.items()}


def _blank(cls, **given):
    """An instance of a contract dataclass with `given` fields and empty others."""
    empty = {"int": 0, "str": ""}
    values = {f.name: given.get(f.name, empty.get(f.type, [])) for f in dataclasses.fields(cls)
              if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return cls(**{**values, **given})


def test_an_error_every_rank_returns_from_fails_that_step_alone(tiny_llama):
    llm = _mp(tiny_llama)
    try:
        executor = _executor(llm)
        bad = SchedulerOutput([], [_blank(CachedRequestData, req_id="unknown")],
                              {"unknown": 1}, 1)
        with pytest.raises(RuntimeError, match="worker rank 0 raised") as info:
            executor.execute(bad)
        assert not isinstance(info.value, WorkerFailed)
        assert "Traceback" in str(info.value)
        executor.check_health()  # the rank goes on
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
    finally:
        llm.engine.shutdown()
    assert _children() == set()


def test_a_worker_killed_mid_run_is_a_clear_error_and_leaves_no_process(tiny_llama):
    llm = _mp(tiny_llama)
    executor = _executor(llm)
    pid = executor.procs[0].pid
    assert _children() == {pid}
    execute, start, steps = executor.execute, executor.execute_async, []

    def kill_on_the_fourth_step(sched):
        steps.append(sched)
        if len(steps) == 4:
            os.kill(pid, signal.SIGKILL)
        return start(sched)

    executor.execute_async = kill_on_the_fourth_step
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    started = time.monotonic()
    try:
        outs = llm.generate(_prompts(), params, use_tqdm=False)
    except RuntimeError as exc:  # the core gave up on the engine (EngineFault)
        assert "worker rank 0" in str(exc)
    else:
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert time.monotonic() - started < FAILURE_BOUND_S
    with pytest.raises(WorkerFailed, match=r"worker rank 0 \(pid \d+\) died .*SIGKILL"):
        executor.check_health()
    with pytest.raises(WorkerFailed, match="worker rank 0"):
        execute(steps[-1])
    assert _children() == set()
    started = time.monotonic()
    llm.engine.shutdown()
    assert time.monotonic() - started < 1.0  # nothing left to wait for
    assert not Path(executor.ipc_dir).exists()


def test_shutdown_kills_a_worker_that_does_not_answer(tiny_llama, monkeypatch):
    monkeypatch.setattr(multiproc, "SHUTDOWN_GRACE_S", 1.0)
    llm = _mp(tiny_llama)
    executor = _executor(llm)
    os.kill(executor.procs[0].pid, signal.SIGSTOP)  # alive, but never reads the shutdown call
    started = time.monotonic()
    llm.engine.shutdown()
    assert time.monotonic() - started < 1.0 + FAILURE_BOUND_S / 3
    assert _children() == set()
    llm.engine.shutdown()  # twice is fine


def test_a_worker_that_cannot_load_fails_the_start_naming_its_error(tiny_llama, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in tiny_llama.iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[:len(data) // 2] if f.suffix == ".safetensors"
                                      else data)
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match=r"start-up .*failed; worker rank 0 raised") as info:
        _mp(broken)
    assert "safetensors" in str(info.value)
    assert time.monotonic() - started < FAILURE_BOUND_S * 2
    assert _children() == set()


def test_a_tensor_parallel_rank_killed_mid_run_fails_its_peer_too(tiny_llama):
    """Rank 1 dies while rank 0 may be waiting on it in an all-reduce: neither hangs."""
    llm = _mp(tiny_llama, tensor_parallel_size=2)
    executor = _executor(llm)
    assert len(_children()) == 2
    start, steps = executor.execute_async, []

    def kill_rank_1_on_the_third_step(sched):
        steps.append(sched)
        if len(steps) == 3:
            os.kill(executor.procs[1].pid, signal.SIGKILL)
        return start(sched)

    executor.execute_async = kill_rank_1_on_the_third_step
    started = time.monotonic()
    try:
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=50, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)
    except RuntimeError as exc:
        assert "worker rank" in str(exc)
    else:
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert time.monotonic() - started < FAILURE_BOUND_S
    with pytest.raises(WorkerFailed, match=r"worker rank [01]"):
        executor.check_health()
    assert _children() == set()
    llm.engine.shutdown()


def test_an_engine_left_to_the_collector_never_hangs_it(tiny_llama):
    """An LLM dropped in a reference cycle without a shutdown: the collector takes the executor,
    its socket and its ZeroMQ context together. A context collected after its socket's weak
    reference was cleared waited forever in term() (a test run hung there)."""
    import subprocess
    import sys

    code = (f"import gc, time\nfrom octavo import LLM\n"
            f"llm = LLM({str(tiny_llama)!r}, distributed_executor_backend='mp', **{KW!r})\n"
            f"cycle = [llm]; cycle.append(cycle); del llm, cycle\n"
            f"gc.collect(); print('collected')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr[-2000:]
