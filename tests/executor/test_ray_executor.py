"""The ray executor on a local Ray cluster (started here, 2 CPUs) and the tiny random Llama: TP=2
gives the mp executor's greedy tokens and prompt logprobs, context parallelism over two actors
one process's; an actor killed mid-run is a clear
error within seconds and leaves no actor; shutdown and ray.shutdown() leave no process; without
Ray the backend is refused naming the extra."""
from __future__ import annotations

import os
import signal
import sys
import time

import pytest

from octavo import LLM, SamplingParams
from octavo.distributed.placement import local_ranks
from tests.executor.procs import alive, children, descendants, gone

ray = pytest.importorskip("ray")

from octavo.executor.ray_executor import RayExecutor, WorkerFailed  # noqa: E402

KW = dict(dtype="float32", max_model_len=256, kv_cache_memory=8 << 20, num_threads=1,
          native_kernels="off", max_num_batched_tokens=32, tensor_parallel_size=2)
FAILURE_BOUND_S = 5.0
# How long processes may take to be gone once killed (a loaded 2-core machine), far below a hang.
EXIT_BOUND_S = 15.0


@pytest.fixture(scope="module")
def ray_cluster():
    assert not ray.is_initialized()
    earlier = descendants()  # other tests' processes still exiting: not the cluster's
    ray.init(num_cpus=2, include_dashboard=False)
    ray_processes = descendants() - earlier
    assert ray_processes  # the cluster's own processes, below this one
    yield
    ray_processes |= descendants() - earlier
    ray.shutdown()
    # Orphans would be re-parented away from this process: follow the pids themselves.
    assert _gone(ray_processes), [p for p in ray_processes if alive(p)]
    assert children() - earlier == set()


def _gone(pids, bound_s: float = EXIT_BOUND_S) -> bool:
    return gone(pids, bound_s)


def _prompts() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 40000 + 100 for j in range(n)]
            for i, n in enumerate((5, 40, 3, 70, 12))]


def _executor(llm: LLM) -> RayExecutor:
    executor = llm.engine.client.core.executor
    assert isinstance(executor, RayExecutor)
    return executor


def _pids(executor: RayExecutor) -> list[int]:
    return [int(name.split("pid ")[1].split(",")[0]) for name in executor.names]


def _logprobs(positions) -> dict[tuple[int, int], float]:
    return {(i, t): lp.logprob for i, d in enumerate(positions) for t, lp in d.items()}


def test_local_ranks_count_each_machine_apart():
    assert local_ranks(["a", "a"]) == [(0, 2), (1, 2)]
    assert local_ranks(["a", "b", "a", "b"]) == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert local_ranks(["a", "b", "b"]) == [(0, 1), (0, 2), (1, 2)]


def test_tensor_parallel_on_ray_actors_gives_the_mp_executors_outputs(tiny_llama, ray_cluster):
    prompts = _prompts()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2,
                            prompt_logprobs=2)
    mp = LLM(str(tiny_llama), distributed_executor_backend="mp", **KW)
    try:
        ref = mp.generate(prompts, params, use_tqdm=False)
    finally:
        mp.engine.shutdown()
    llm = LLM(str(tiny_llama), distributed_executor_backend="ray", **KW)
    executor = _executor(llm)
    pids, group = _pids(executor), executor.placement_group
    try:
        assert "2 Ray actors on 1 node(s) (tp 2, pp 1)" in executor.describe()
        executor.check_health()
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        started = time.monotonic()
        llm.engine.shutdown()
        assert time.monotonic() - started < FAILURE_BOUND_S
    assert _gone(pids)
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _logprobs(a.outputs[0].logprobs) == \
            pytest.approx(_logprobs(b.outputs[0].logprobs), abs=1e-5)
        assert _logprobs(a.prompt_logprobs[1:]) == \
            pytest.approx(_logprobs(b.prompt_logprobs[1:]), abs=1e-5)
    with pytest.raises(WorkerFailed, match="shut down"):
        executor.check_health()
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_context_parallel_ranks_on_ray_actors_give_one_process_outputs(tiny_llama, ray_cluster):
    """Both context-parallel modes on two actors: the group's collectives run between actors."""
    prompts = _prompts()
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, prompt_logprobs=2)
    kw = {**KW, "tensor_parallel_size": 1}
    one = LLM(str(tiny_llama), **kw)
    try:
        ref = one.generate(prompts, params, use_tqdm=False)
    finally:
        one.engine.shutdown()
    llm = LLM(str(tiny_llama), distributed_executor_backend="ray", **kw,
              prefill_context_parallel_size=2, decode_context_parallel_size=2)
    try:
        assert "(tp 1, cp 2, pp 1)" in _executor(llm).describe()
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    for a, b in zip(outs, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert _logprobs(a.prompt_logprobs[1:]) == \
            pytest.approx(_logprobs(b.prompt_logprobs[1:]), abs=1e-4)


def test_an_actor_killed_mid_run_is_a_clear_error_within_seconds(tiny_llama, ray_cluster):
    llm = LLM(str(tiny_llama), distributed_executor_backend="ray", **KW)
    executor = _executor(llm)
    pids, group = _pids(executor), executor.placement_group
    start, steps, killed = executor.execute_async, [], []

    def kill_rank_1_on_the_third_step(sched):
        steps.append(sched)
        if len(steps) == 3:
            os.kill(pids[1], signal.SIGKILL)
            killed.append(time.monotonic())
        return start(sched)

    executor.execute_async = kill_rank_1_on_the_third_step
    try:
        outs = llm.generate(_prompts(), SamplingParams(max_tokens=50, temperature=0,
                                                       ignore_eos=True), use_tqdm=False)
    except RuntimeError as exc:  # the core gave up on the engine (EngineFault)
        assert "worker rank 1" in str(exc)
    else:
        assert all(o.outputs[0].finish_reason == "abort" for o in outs)
    assert time.monotonic() - killed[0] < FAILURE_BOUND_S
    with pytest.raises(WorkerFailed, match=r"worker rank 1 \(pid \d+, node [\d.]+\) died during "
                                           r"execute: ActorDiedError"):
        executor.check_health()
    assert _gone(pids)  # rank 0 killed too
    started = time.monotonic()
    llm.engine.shutdown()
    assert time.monotonic() - started < FAILURE_BOUND_S
    assert ray.util.placement_group_table(group)["state"] == "REMOVED"


def test_without_ray_the_backend_is_refused_naming_the_extra(tiny_llama, monkeypatch):
    before = children()
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'octavo\[ray\]'"):
        LLM(str(tiny_llama), distributed_executor_backend="ray", **KW)
    assert children() == before
