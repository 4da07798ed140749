"""EngineCore around a fake, torch-free Executor."""
from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.engine_core import EngineCore
from octavo.executor.base import Executor
from tests.core.core_requests import submit
from tests.core.fakes import EOS, FakeWorker, make_request, token_at


class FakeExecutor(Executor):
    def __init__(self, num_blocks: int, token_fn=None) -> None:
        self.num_blocks = num_blocks
        self.token_fn = token_fn
        self.init_calls: list[tuple[int, int]] = []
        self.executed: list[SchedulerOutput] = []
        self.worker: FakeWorker | None = None
        self.shut_down = False

    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        self.init_calls.append((kv_cache_memory, block_size))
        self.worker = FakeWorker(block_size, self.token_fn)
        return self.num_blocks

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        self.executed.append(scheduler_output)
        return self.worker.execute(scheduler_output)

    def shutdown(self) -> None:
        self.shut_down = True


def make_core(num_blocks=32, block_size=4, max_model_len=64, token_fn=None, **sched):
    config = EngineConfig.from_kwargs(block_size=block_size, kv_cache_memory=12345, **sched)
    executor = FakeExecutor(num_blocks, token_fn)
    return EngineCore(config, executor, max_model_len), executor


def test_kv_cache_is_sized_by_the_executor():
    core, ex = make_core(num_blocks=20, block_size=8, max_model_len=100)
    assert ex.init_calls == [(12345, 8)]
    assert core.num_blocks == 20
    kv = core.scheduler.kv
    assert kv.block_size == 8 and kv.pool.num_blocks == 20
    assert core.scheduler.max_model_len == 100


def test_config_reaches_the_scheduler():
    core, _ = make_core(max_num_seqs=3, max_num_batched_tokens=17)
    assert core.scheduler.max_num_seqs == 3
    assert core.scheduler.max_num_batched_tokens == 17


@pytest.mark.parametrize("num_blocks, block_size, max_model_len", [
    (3, 16, 49), (0, 16, 1), (15, 4, 61), (1, 1, 2)])
def test_kv_cache_smaller_than_max_model_len_raises(num_blocks, block_size, max_model_len):
    with pytest.raises(ValueError, match="max_model_len"):
        make_core(num_blocks=num_blocks, block_size=block_size, max_model_len=max_model_len)


def test_kv_cache_exactly_max_model_len_is_enough():
    core, _ = make_core(num_blocks=4, block_size=16, max_model_len=64)
    submit(core, make_request("a", 63, max_tokens=1))
    outs = []
    while core.has_unfinished_requests():
        outs += core.step()
    assert [(o.req_id, o.finish_reason) for o in outs] == [("a", "length")]


def test_step_without_work_does_not_call_the_executor():
    core, ex = make_core()
    assert not core.has_unfinished_requests()
    assert core.step() == []
    assert ex.executed == []


def test_requests_run_to_completion():
    core, ex = make_core(token_fn=lambda req_id, i: EOS if (req_id, i) == ("b", 2) else token_at(i),
                         max_num_batched_tokens=16, max_num_seqs=2)
    submit(core, make_request("a", 30, max_tokens=5))
    submit(core, make_request("b", 5, max_tokens=10))
    submit(core, make_request("c", 5, max_tokens=3))
    with pytest.raises(ValueError):
        submit(core, make_request("a", 3))
    tokens, reasons = {}, {}
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                reasons[o.req_id] = o.finish_reason
    assert reasons == {"a": "length", "b": "stop", "c": "length"}
    assert tokens == {"a": [token_at(i) for i in range(5)], "b": [token_at(0), token_at(1), EOS],
                      "c": [token_at(i) for i in range(3)]}
    assert all(s.total_num_scheduled_tokens <= 16 for s in ex.executed)
    stats = core.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    core.shutdown()
    assert ex.shut_down


def test_abort_through_the_core():
    core, ex = make_core()
    submit(core, make_request("a", 8))
    submit(core, make_request("b", 8))
    core.step()
    assert core.abort_requests(["a", "zzz"]) == ["a"]
    core.step()
    assert "a" in ex.executed[-1].finished_req_ids
    assert "a" not in ex.worker.reqs


def test_finished_ids_reach_the_worker_even_when_nothing_else_runs():
    """The worker must hear of every finished request, or it keeps its state forever."""
    core, ex = make_core()
    submit(core, make_request("a", 8, max_tokens=50))
    core.step()
    assert "a" in ex.worker.reqs
    core.abort_requests(["a"])
    assert not core.has_unfinished_requests()
    assert core.step() == []
    assert ex.executed[-1].finished_req_ids == {"a"}
    assert ex.executed[-1].total_num_scheduled_tokens == 0
    assert ex.worker.reqs == {}
    n = len(ex.executed)
    assert core.step() == []  # and then there is nothing left to tell it
    assert len(ex.executed) == n


def test_finished_ids_after_a_natural_finish_reach_the_worker():
    core, ex = make_core()
    submit(core, make_request("a", 8, max_tokens=2))
    outs = core.step() + core.step()
    assert outs[-1].finish_reason == "length"
    core.step()
    assert ex.worker.reqs == {}


# -- a step that raises ---------------------------------------------------------------------------

class _PoisonExecutor(FakeExecutor):
    """Raises on any step that computes tokens of a request whose id starts with 'bad', once
    the request has computed more than `after` tokens (so the fault can sit mid-request);
    `before_worker`: it raises before the worker has seen the step at all."""

    def __init__(self, num_blocks: int, after: int = 0, before_worker: bool = False) -> None:
        super().__init__(num_blocks)
        self.after = after
        self.before_worker = before_worker
        self.failures = 0

    def execute(self, scheduler_output: SchedulerOutput) -> ModelOutput:
        computed = {n.req_id: n.num_computed_tokens for n in scheduler_output.new_requests}
        computed.update({c.req_id: c.num_computed_tokens
                         for c in scheduler_output.cached_requests})
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            if req_id.startswith("bad") and computed[req_id] + n > self.after:
                if not self.before_worker:  # the worker took the step in, then failed
                    self.worker.apply(scheduler_output)
                self.failures += 1
                raise RuntimeError(f"poisoned by {req_id}")
        return self.worker.execute(scheduler_output)


def _run(core, limit=400):
    outs: dict[str, list] = {}
    steps = 0
    while core.has_unfinished_requests() and steps < limit:
        for o in core.step():
            outs.setdefault(o.req_id, []).append(o)
        steps += 1
    assert not core.has_unfinished_requests(), "the core stopped making progress"
    return outs


@pytest.mark.parametrize("after, before_worker", [(0, False), (10, False), (0, True),
                                                  (10, True)])
def test_a_request_whose_step_raises_is_aborted_and_the_others_finish(after, before_worker):
    core, ex = _make_poison_core(after, before_worker=before_worker)
    submit(core, make_request("earlier", prompt_len=6, max_tokens=2))
    _run(core)  # its drop reaches the worker with the next step, the one that fails
    for req_id in ("a", "bad", "b", "c"):
        submit(core, make_request(req_id, prompt_len=6, max_tokens=8))
    outs = _run(core)
    # Whatever the worker still holds is told to go with the next step: nothing leaks.
    assert set(ex.worker.reqs) <= core.scheduler._finished_ids
    bad = outs["bad"][-1]
    assert bad.finish_reason == "abort" and "poisoned by bad" in bad.stop_reason
    for req_id in ("a", "b", "c"):
        tokens = [t for o in outs[req_id] for t in o.new_token_ids]
        assert tokens == [token_at(i) for i in range(8)], req_id
        assert outs[req_id][-1].finish_reason == "length"
    assert core.scheduler.kv.pool.num_free_blocks == core.num_blocks
    assert not core.faults.suspects and core.scheduler.isolated is None


def test_a_failed_step_leaves_nothing_findable_in_the_prefix_cache():
    core, ex = _make_poison_core(0, enable_prefix_caching=True)
    submit(core, make_request("ok", prompt_len=12, max_tokens=2))
    submit(core, make_request("bad", prompt_len=12, max_tokens=2))  # same prompt tokens
    pool = core.scheduler.kv.pool
    assert core.step() == [] and ex.failures == 1  # both ran: both requeued, none blamed
    assert not pool.cached, "blocks of the failed step are still findable by their hash"
    assert set(core.faults.suspects) == {"ok", "bad"}
    outs = _run(core)
    assert outs["bad"][-1].finish_reason == "abort"
    assert [t for o in outs["ok"] for t in o.new_token_ids] == [token_at(0), token_at(1)]
    assert ex.failures == 2  # once together, once alone


def test_steps_that_fail_whatever_runs_fail_the_engine():
    from octavo.core.faults import MAX_LONE_FAILURES, EngineFault

    core, ex = _make_poison_core(0)
    for i in range(MAX_LONE_FAILURES + 1):
        submit(core, make_request(f"bad{i}", prompt_len=4, max_tokens=2))
    with pytest.raises(EngineFault, match="the engine, not a request"):
        _run(core)


def _make_poison_core(after, before_worker=False, **kw):
    config = EngineConfig.from_kwargs(block_size=4, kv_cache_memory=12345, **kw)
    ex = _PoisonExecutor(64, after, before_worker)
    return EngineCore(config, ex, 64), ex


def test_a_suspect_run_alone_gets_room_from_requests_that_hold_blocks():
    """The suspect the scheduler runs alone needs more blocks than are free: the running
    requests set aside for it are preempted to make room, so isolation never stalls."""
    from tests.core.fakes import make_scheduler, step

    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("hog", 16, max_tokens=4))
    step(s)  # "hog" holds 5 of the 6 blocks
    s.add_request(make_request("suspect", 12, max_tokens=2))  # needs 3
    s.isolated = "suspect"
    out = s.schedule()
    assert out.num_scheduled_tokens == {"suspect": 12}
    assert out.preempted_req_ids == {"hog"}


def test_a_replica_in_lockstep_runs_an_empty_step_and_stops_on_a_failed_execution():
    """step_in_lockstep: one execution per call (an empty schedule where nothing is scheduled);
    a failed scheduling or update is a request's fault as in step(), but a failed execution
    ends the replica (the others' ranks may wait on this one's in a layer it never reached)."""
    from octavo.core.engine_core import LockstepBroken

    core, ex = make_core()
    assert core.step_in_lockstep() == [] and len(ex.executed) == 1
    assert ex.executed[0].total_num_scheduled_tokens == 0
    submit(core, make_request("a", 3, max_tokens=2))
    while core.has_unfinished_requests():
        core.step_in_lockstep()
    assert all(s.total_num_scheduled_tokens for s in ex.executed[1:])

    core = EngineCore(EngineConfig.from_kwargs(block_size=4, kv_cache_memory=12345),
                      _PoisonExecutor(32), 64)
    submit(core, make_request("bad", 3, max_tokens=2))
    with pytest.raises(LockstepBroken, match="replicas stop"):
        core.step_in_lockstep()
