"""EngineCore around a fake, torch-free Executor."""
from __future__ import annotations

import pytest

from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.engine_core import EngineCore
from octavo.executor.base import Executor
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
    core.add_request(make_request("a", 63, max_tokens=1))
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
    core.add_request(make_request("a", 30, max_tokens=5))
    core.add_request(make_request("b", 5, max_tokens=10))
    core.add_request(make_request("c", 5, max_tokens=3))
    with pytest.raises(ValueError):
        core.add_request(make_request("a", 3))
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
    core.add_request(make_request("a", 8))
    core.add_request(make_request("b", 8))
    core.step()
    assert core.abort_requests(["a", "zzz"]) == ["a"]
    core.step()
    assert "a" in ex.executed[-1].finished_req_ids
    assert "a" not in ex.worker.reqs


def test_finished_ids_reach_the_worker_even_when_nothing_else_runs():
    """The worker must hear of every finished request, or it keeps its state forever."""
    core, ex = make_core()
    core.add_request(make_request("a", 8, max_tokens=50))
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
    core.add_request(make_request("a", 8, max_tokens=2))
    outs = core.step() + core.step()
    assert outs[-1].finish_reason == "length"
    core.step()
    assert ex.worker.reqs == {}
