"""Data-parallel replicas on Ray (`data_parallel_backend="ray"`) on a local Ray cluster started
here (2 CPUs: one a replica): the same greedy outputs as one core, both replicas used, each on
its own core; a replica whose actor is killed is a clear error naming it; shutdown leaves no
actor; a cluster too small for the replicas is a clear error, and leaves no actor; experts
spanning the replicas give transformers' outputs."""
from __future__ import annotations

import time

import pytest

from octavo import LLM, SamplingParams
from tests.executor.procs import alive, gone

ray = pytest.importorskip("ray")

from octavo.engine import core_launch_ray  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time",
           "The three primary colors are", "import numpy as np\n", "Water boils at"]
KW = dict(dtype="float32", max_model_len=512, kv_cache_memory=64 << 20,
          data_parallel_size=2, data_parallel_backend="ray")


@pytest.fixture(scope="module")
def ray_cluster():
    assert not ray.is_initialized()
    ray.init(num_cpus=2, include_dashboard=False)
    yield
    ray.shutdown()


def test_replicas_on_ray_give_one_cores_outputs(smollm_llm, smollm_gguf, ray_cluster):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    expected = smollm_llm.generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(smollm_gguf), **KW)
    replicas = llm.engine.client.replicas
    pids = [r.pid for r in replicas]
    try:
        assert all(isinstance(r.launch, core_launch_ray.RayCoreLaunch) for r in replicas)
        assert all(r.launch.input_addr.startswith("tcp://") for r in replicas)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == \
            [e.outputs[0].token_ids for e in expected]
        assert all(r.stats.prefix_cache_queries > 0 for r in replicas)
        assert [r.launch.place for r in replicas] == [(0, 2), (1, 2)]  # one machine, a core each
        # A replica whose actor dies is an error naming it, not a hang.
        ray.kill(replicas[1].process.actor, no_restart=True)
        with pytest.raises(RuntimeError, match="engine core 1 exited"):
            llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.engine.shutdown()
    assert not any(r.process.is_alive() for r in replicas)
    assert gone(pids, 15.0), [p for p in pids if alive(p)]
    _all_cpus_free()
    assert ray.is_initialized()  # the cluster was the test's: octavo leaves it running


def test_experts_span_replicas_on_ray(tmp_path, smollm_oracle_folder, ray_cluster):
    """Expert parallelism over two replicas on Ray (a tiny random Qwen3-MoE): the replicas'
    ranks meet at the first one's node, and the outputs equal transformers'."""
    from tests.distributed.test_tensor_parallel import _check, _prompt, _reference, _run
    from tests.parity.test_tiny_models import _build

    folder, ref = _build(tmp_path, smollm_oracle_folder, "qwen3-moe")
    prompts = [_prompt(1), _prompt(2)[:60]]
    expected = [_reference(ref, p) for p in prompts]
    llm = LLM(str(folder), dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
              data_parallel_size=2, data_parallel_backend="ray", enable_expert_parallel=True)
    try:
        for out, prompt, exp in zip(_run(llm, prompts), prompts, expected):
            _check(out, prompt, *exp)
        routed = llm.engine.client.stats().expert_tokens
        assert len(routed) == 2 and min(routed) > 0
    finally:
        llm.engine.shutdown()
    _all_cpus_free()


def test_a_cluster_too_small_is_a_clear_error(smollm_gguf, ray_cluster, monkeypatch):
    monkeypatch.setattr(core_launch_ray, "PLACEMENT_TIMEOUT_S", 3.0)
    with pytest.raises(RuntimeError, match="cannot place 3 data-parallel replicas"):
        LLM(str(smollm_gguf), **{**KW, "data_parallel_size": 3, "num_threads": 1})
    _all_cpus_free()


def _all_cpus_free(bound_s: float = 15.0) -> None:
    """No actor of octavo's is left holding the cluster's CPUs."""
    deadline = time.monotonic() + bound_s
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)
