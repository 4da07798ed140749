"""Several batches in flight (pipeline stages): the core schedules the next batch from the
requests not in flight while earlier batches run, and takes outputs back oldest first. Against
a fake executor whose steps finish only when the core asks for their result."""
from __future__ import annotations

from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.engine_core import EngineCore
from octavo.executor.base import PendingOutput
from tests.core.core_requests import submit
from tests.core.fakes import make_request
from tests.core.test_engine_core import FakeExecutor


class _Later(PendingOutput):
    def __init__(self, executor: _PipelinedExecutor, sched: SchedulerOutput) -> None:
        self.executor, self.sched = executor, sched

    def done(self) -> bool:
        return False  # the core must not wait on it while there is room for another batch

    def result(self) -> ModelOutput:
        self.executor.in_flight.remove(self.sched)
        return FakeExecutor.execute(self.executor, self.sched)


class _PipelinedExecutor(FakeExecutor):
    max_concurrent_batches = 2

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.in_flight: list[SchedulerOutput] = []
        self.most_in_flight = 0

    def execute_async(self, sched: SchedulerOutput) -> PendingOutput:
        for other in self.in_flight:  # a request is in one batch at a time
            assert not set(other.num_scheduled_tokens) & set(sched.num_scheduled_tokens)
        self.in_flight.append(sched)
        self.most_in_flight = max(self.most_in_flight, len(self.in_flight))
        return _Later(self, sched)


def _run(executor: FakeExecutor, **sched) -> dict[str, list[int]]:
    config = EngineConfig.from_kwargs(block_size=4, kv_cache_memory=12345, **sched)
    core = EngineCore(config, executor, 64)
    for i, n in enumerate((10, 7, 12)):
        submit(core, make_request(f"r{i}", n, max_tokens=6))
    tokens: dict[str, list[int]] = {}
    steps = 0
    while core.has_unfinished_requests():
        for out in core.step():
            tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        steps += 1
        assert steps < 200
    assert not core.batches and not core.scheduler.in_flight
    return tokens


def test_two_batches_in_flight_give_the_tokens_of_one_at_a_time():
    # A budget of 8 tokens: the prompts take several chunks, so batches alternate requests.
    expected = _run(FakeExecutor(32), max_num_batched_tokens=8)
    pipelined = _PipelinedExecutor(32)
    assert _run(pipelined, max_num_batched_tokens=8) == expected
    assert pipelined.most_in_flight == 2


def test_a_request_aborted_in_flight_has_its_batch_taken_back():
    executor = _PipelinedExecutor(32)
    config = EngineConfig.from_kwargs(block_size=4, kv_cache_memory=12345)
    core = EngineCore(config, executor, 64)
    submit(core, make_request("a", 5, max_tokens=4))
    assert core.step() == []  # started, not waited for
    core.abort_requests(["a"])
    assert core.has_unfinished_requests()  # its batch is still out
    while core.has_unfinished_requests():
        core.step()
    assert not executor.in_flight and not core.scheduler.in_flight
