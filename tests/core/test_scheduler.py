"""The scheduler, driven by a fake worker: chunked prefill, budgets, preemption, priority,
abort, stop conditions, and a randomized simulation checking the invariants every step."""
from __future__ import annotations

import math
import random
import subprocess
import sys

import pytest

from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.kv_manager import cdiv
from octavo.core.request import RequestStatus
from tests.core.fakes import (
    EOS, STOP, FakeWorker, make_request, make_scheduler, run_to_completion, step, token_at)


def test_core_does_not_import_torch():
    code = ("import octavo.core.scheduler, octavo.core.engine_core, octavo.core.kv_manager, "
            "octavo.core.structured, sys; "
            "assert 'torch' not in sys.modules, 'the core imported torch'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr


def free_all(scheduler) -> bool:
    pool = scheduler.kv.pool
    return pool.num_free_blocks == pool.num_blocks and not scheduler.kv.block_tables


# -- adding requests -----------------------------------------------------------------------------

def test_duplicate_request_id_raises():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(make_request("a", 7))
    assert len(s.waiting) == 1 and s.requests["a"].num_prompt_tokens == 5


def test_duplicate_of_a_running_request_raises():
    s = make_scheduler()
    s.add_request(make_request("a", 5))
    step(s)
    assert s.requests["a"].status == RequestStatus.RUNNING
    with pytest.raises(ValueError):
        s.add_request(make_request("a", 5))
    assert len(s.running) == 1 and not s.waiting


def test_empty_schedule():
    s = make_scheduler()
    sched = s.schedule()
    assert sched.total_num_scheduled_tokens == 0
    assert sched.num_scheduled_tokens == {} and not sched.new_requests
    assert not sched.cached_requests and not sched.finished_req_ids
    assert not s.has_unfinished_requests()
    assert SchedulerOutput.empty().total_num_scheduled_tokens == 0


def test_stats():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_seqs=2)
    for name in "abc":
        s.add_request(make_request(name, 8))
    stats = s.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 3, 0.0)
    step(s)
    stats = s.stats()
    assert (stats.num_running, stats.num_waiting) == (2, 1)
    assert stats.kv_cache_usage == pytest.approx(4 / 10)
    assert stats.num_preemptions == 0


# -- chunked prefill -----------------------------------------------------------------------------

def test_long_prompt_is_prefilled_in_chunks():
    s = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=32)
    s.add_request(make_request("long", 100, max_tokens=3))
    worker = FakeWorker(16)

    chunks, new_blocks = [], []
    for i in range(4):
        sched = s.schedule()
        assert list(sched.num_scheduled_tokens) == ["long"]
        assert sched.total_num_scheduled_tokens <= 32
        chunks.append(sched.num_scheduled_tokens["long"])
        if i == 0:
            (new,) = sched.new_requests
            assert not sched.cached_requests
            assert new.num_computed_tokens == 0 and new.num_prompt_tokens == 100
            assert len(new.token_ids) == 100
            new_blocks.append(len(new.block_ids))
        else:
            (cached,) = sched.cached_requests
            assert not sched.new_requests
            assert cached.num_computed_tokens == 32 * i
            new_blocks.append(len(cached.new_block_ids))
        out = worker.execute(sched)
        outs = s.update_from_output(sched, out)
        if i < 3:
            assert out.sampled_token_ids == [[]]
            assert outs == []  # nothing to report for a chunk that does not reach the end
            assert s.requests["long"].output_token_ids == []
        else:
            assert [o.new_token_ids for o in outs] == [[token_at(0)]]
    assert chunks == [32, 32, 32, 4]
    assert new_blocks == [2, 2, 2, 1]
    assert s.requests["long"].num_computed_tokens == 100
    assert len(s.kv.blocks_of("long")) == math.ceil(100 / 16)

    sched = s.schedule()  # now a decode
    assert sched.num_scheduled_tokens == {"long": 1}


def test_chunked_prefill_shares_steps_with_decodes_scheduled_first():
    s = make_scheduler(num_blocks=64, block_size=16, max_num_batched_tokens=32)
    for i in range(3):
        s.add_request(make_request(f"d{i}", 4, max_tokens=50))
    worker = FakeWorker(16)
    sched = s.schedule()  # the three short prompts in one step
    assert sched.num_scheduled_tokens == {"d0": 4, "d1": 4, "d2": 4}
    s.update_from_output(sched, worker.execute(sched))

    s.add_request(make_request("long", 100, max_tokens=3))
    chunks = []
    while True:
        sched = s.schedule()
        order = list(sched.num_scheduled_tokens)
        assert order[:3] == ["d0", "d1", "d2"]  # running decodes come first
        assert all(sched.num_scheduled_tokens[f"d{i}"] == 1 for i in range(3))
        assert sched.total_num_scheduled_tokens <= 32
        if "long" not in sched.num_scheduled_tokens:
            break
        assert order[3] == "long"
        chunks.append(sched.num_scheduled_tokens["long"])
        outs = s.update_from_output(sched, worker.execute(sched))
        assert {o.req_id for o in outs} >= {"d0", "d1", "d2"}
        if sum(chunks) == 100:
            break
    assert chunks == [29, 29, 29, 13]
    assert s.requests["long"].output_token_ids == [token_at(0)]


def test_decodes_exhausting_the_budget_keep_waiting_prompts_out():
    s = make_scheduler(max_num_batched_tokens=12)
    for i in range(3):
        s.add_request(make_request(f"d{i}", 4, max_tokens=50))
    step(s)
    s.add_request(make_request("w", 4))
    s.max_num_batched_tokens = 3  # exactly the three decodes
    sched, _ = step(s)
    assert sched.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1}
    assert s.requests["w"].status == RequestStatus.WAITING
    s.max_num_batched_tokens = 5
    sched, _ = step(s)
    assert sched.num_scheduled_tokens == {"d0": 1, "d1": 1, "d2": 1, "w": 2}


def test_max_num_seqs_caps_admission():
    s = make_scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(5):
        s.add_request(make_request(f"r{i}", 4, max_tokens=2 + i))
    sched, _ = step(s)
    assert list(sched.num_scheduled_tokens) == ["r0", "r1"]
    assert len(s.running) == 2 and len(s.waiting) == 3
    # r0 finishes after 2 tokens: the next step admits r2 in its place.
    sched, outs = step(s)
    assert [(o.req_id, o.finish_reason) for o in outs] == [("r0", "length"), ("r1", None)]
    sched, _ = step(s)
    assert list(sched.num_scheduled_tokens) == ["r1", "r2"]
    assert sched.finished_req_ids == {"r0"}
    outputs = run_to_completion(s)
    assert free_all(s)
    assert sum(len(o.new_token_ids) for o in outputs["r4"]) == 6


# -- stop conditions -----------------------------------------------------------------------------

def emit(at: dict[int, int]):
    """A token function: token `at[i]` at output position i, the default elsewhere."""
    return lambda req_id, index: at.get(index, token_at(index))


def run_one(req, token_fn=None, max_model_len=None):
    s = make_scheduler(max_model_len=max_model_len)
    s.add_request(req)
    outputs = run_to_completion(s, token_fn)[req.req_id]
    assert all(o.finish_reason is None for o in outputs[:-1])
    tokens = [t for o in outputs for t in o.new_token_ids]
    assert tokens == req.output_token_ids
    assert free_all(s)
    return outputs[-1], tokens, req


def test_eos_stops():
    last, tokens, req = run_one(make_request("a", 5, max_tokens=10), emit({2: EOS}))
    assert last.finish_reason == "stop" and last.stop_reason is None
    assert tokens == [token_at(0), token_at(1), EOS]
    assert req.status == RequestStatus.FINISHED_STOPPED


def test_ignore_eos_continues_to_max_tokens():
    last, tokens, _ = run_one(make_request("a", 5, max_tokens=10, ignore_eos=True),
                              lambda req_id, index: EOS)
    assert last.finish_reason == "length"
    assert tokens == [EOS] * 10


def test_stop_token_id_sets_stop_reason():
    last, tokens, req = run_one(make_request("a", 5, max_tokens=10, stop_token_ids=[STOP]),
                                emit({3: STOP}))
    assert last.finish_reason == "stop" and last.stop_reason == STOP
    assert len(tokens) == 4 and tokens[-1] == STOP
    assert req.stop_reason == STOP


def test_stop_token_id_stops_even_with_ignore_eos():
    last, tokens, _ = run_one(
        make_request("a", 5, max_tokens=10, stop_token_ids=[STOP], ignore_eos=True),
        emit({0: EOS, 1: STOP}))
    assert (last.finish_reason, last.stop_reason) == ("stop", STOP)
    assert tokens == [EOS, STOP]


def test_min_tokens_delays_eos():
    last, tokens, _ = run_one(make_request("a", 5, max_tokens=10, min_tokens=3),
                              lambda req_id, index: EOS)
    # The stop is honoured once the output holds min_tokens tokens (as vLLM's check_stop).
    assert last.finish_reason == "stop"
    assert tokens == [EOS] * 3


def test_min_tokens_delays_stop_token_ids():
    last, tokens, _ = run_one(
        make_request("a", 5, max_tokens=10, min_tokens=4, stop_token_ids=[STOP]),
        emit({0: STOP, 2: STOP, 5: STOP}))
    assert (last.finish_reason, last.stop_reason) == ("stop", STOP)
    assert len(tokens) == 6


def test_eos_before_min_tokens_then_nothing_runs_to_length():
    last, tokens, _ = run_one(make_request("a", 5, max_tokens=6, min_tokens=2), emit({0: EOS}))
    assert last.finish_reason == "length" and len(tokens) == 6


@pytest.mark.parametrize("max_tokens", [1, 2, 7])
def test_max_tokens_gives_length(max_tokens):
    last, tokens, req = run_one(make_request("a", 5, max_tokens=max_tokens))
    assert last.finish_reason == "length" and last.stop_reason is None
    assert tokens == [token_at(i) for i in range(max_tokens)]
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_eos_on_the_last_allowed_token_is_a_stop():
    last, tokens, _ = run_one(make_request("a", 5, max_tokens=3), emit({2: EOS}))
    assert last.finish_reason == "stop" and len(tokens) == 3


def test_max_model_len_caps_output():
    last, tokens, _ = run_one(make_request("a", 10, max_tokens=20), max_model_len=13)
    assert last.finish_reason == "length"
    assert len(tokens) == 3  # prompt + output == max_model_len


# -- preemption and resumption -------------------------------------------------------------------

def test_preemption_and_resumption():
    # 4 blocks of 4 tokens: two 6-token prompts fit, growing both past 8 tokens does not.
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, max_model_len=16)
    worker = FakeWorker(4)
    a, b = make_request("a", 6, max_tokens=8), make_request("b", 6, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    collected = {"a": [], "b": []}

    def do_step():
        sched = s.schedule()
        for o in s.update_from_output(sched, worker.execute(sched)):
            collected[o.req_id].extend(o.new_token_ids)
        return sched

    for _ in range(3):  # 6, 7, 8 tokens computed: two blocks each
        sched = do_step()
        assert not sched.preempted_req_ids
    assert a.num_tokens == b.num_tokens == 9 and s.kv.pool.num_free_blocks == 0
    sched = do_step()  # a needs a third block for its 9th token: b, the latest, goes
    assert sched.preempted_req_ids == {"b"}
    assert list(sched.num_scheduled_tokens) == ["a"]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert s.waiting == [b] and s.running == [a]
    assert s.kv.blocks_of("b") == []
    assert b.output_token_ids == [token_at(0), token_at(1), token_at(2)]  # kept
    assert s.stats().num_preemptions == 1

    resumed = None
    while s.has_unfinished_requests():
        sched = do_step()
        assert not sched.preempted_req_ids
        for new in sched.new_requests:
            assert new.req_id == "b" and resumed is None
            resumed = new
            assert new.token_ids == b.prompt_token_ids + [token_at(i) for i in range(3)]
            assert new.num_prompt_tokens == 6 and new.num_computed_tokens == 0
            assert new.block_ids == s.kv.blocks_of("b")
            assert sched.num_scheduled_tokens["b"] == 9  # the whole sequence is recomputed
            assert a.status.finished  # no room for b while a still grew
    assert resumed is not None
    assert collected["a"] == [token_at(i) for i in range(8)]
    assert collected["b"] == [token_at(i) for i in range(8)]
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert free_all(s)


def test_preempted_request_is_readmitted_before_later_arrivals():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    for name in "abc":
        s.add_request(make_request(name, 8, max_tokens=4))
    sched, _ = step(s)
    assert len(sched.new_requests) == 3
    s.add_request(make_request("d", 4, max_tokens=4))
    sched, _ = step(s)
    assert sched.preempted_req_ids == {"c"}
    assert [r.req_id for r in s.waiting] == ["c", "d"]
    admitted = []
    while s.has_unfinished_requests():
        sched, _ = step(s)
        admitted += [n.req_id for n in sched.new_requests]
    assert admitted[0] == "c"


def test_worker_output_for_a_preempted_request_is_dropped():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    step(s)
    sched = s.schedule()
    assert sched.preempted_req_ids == {"b"}
    outs = s.update_from_output(sched, ModelOutput(["a", "b"], [[5], [6]]))
    assert [o.req_id for o in outs] == ["a"]
    assert b.output_token_ids == [token_at(0)]


# -- priority (scheduling_policy priority; more in test_priority_scheduling.py) -----------------

def test_lower_priority_value_is_admitted_first():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("late-low", 4, max_tokens=1, priority=2))
    s.add_request(make_request("high", 4, max_tokens=1, priority=0))
    s.add_request(make_request("mid-1", 4, max_tokens=1, priority=1))
    s.add_request(make_request("mid-2", 4, max_tokens=1, priority=1))
    s.add_request(make_request("high-2", 4, max_tokens=1, priority=0))
    assert [r.req_id for r in s.waiting] == ["high", "high-2", "mid-1", "mid-2", "late-low"]
    order = []
    while s.has_unfinished_requests():
        sched, _ = step(s)
        order += [n.req_id for n in sched.new_requests]
    assert order == ["high", "high-2", "mid-1", "mid-2", "late-low"]


def test_priority_orders_the_batch():
    s = make_scheduler(max_num_seqs=4, scheduling_policy="priority")
    s.add_request(make_request("low", 4, max_tokens=5, priority=1))
    step(s)
    s.add_request(make_request("high", 4, max_tokens=5, priority=0))
    step(s)
    assert [r.req_id for r in s.running] == ["high", "low"]
    sched, _ = step(s)
    assert list(sched.num_scheduled_tokens) == ["high", "low"]


@pytest.mark.parametrize("priorities, victim", [
    ({"a": 0, "b": 0, "c": 0}, "c"),  # equal priority: the latest
    ({"a": 1, "b": 0, "c": 0}, "a"),  # the lowest priority, though the earliest
    ({"a": 0, "b": 2, "c": 1}, "b"),
])
def test_preemption_victim_is_lowest_priority_then_latest(priorities, victim):
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24,
                       scheduling_policy="priority")
    for name in "abc":
        s.add_request(make_request(name, 8, max_tokens=4, priority=priorities[name]))
    sched, _ = step(s)
    assert len(sched.new_requests) == 3 and s.kv.pool.num_free_blocks == 0
    sched, _ = step(s)
    assert sched.preempted_req_ids == {victim}
    assert set(sched.num_scheduled_tokens) == set("abc") - {victim}
    run_to_completion(s)
    assert free_all(s)


# -- abort ---------------------------------------------------------------------------------------

def _to_state(state: str):
    """A scheduler holding request 'x' in the given state, plus the worker that ran it."""
    if state == "preempted":
        s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16)
        worker = FakeWorker(4)
        s.add_request(make_request("a", 6, max_tokens=8))
        s.add_request(make_request("x", 6, max_tokens=8))
        for _ in range(4):
            sched = s.schedule()
            s.update_from_output(sched, worker.execute(sched))
        assert sched.preempted_req_ids == {"x"}
        assert s.requests["x"].status == RequestStatus.PREEMPTED
        return s, worker
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    worker = FakeWorker(4)
    s.add_request(make_request("x", 40, max_tokens=20))
    steps = {"waiting": 0, "prefill": 1, "decode": 4}[state]
    for _ in range(steps):
        sched = s.schedule()
        s.update_from_output(sched, worker.execute(sched))
    x = s.requests["x"]
    if state == "waiting":
        assert x.status == RequestStatus.WAITING
    elif state == "prefill":
        assert x.status == RequestStatus.RUNNING and 0 < x.num_computed_tokens < 40
    else:
        assert x.status == RequestStatus.RUNNING and len(x.output_token_ids) == 2
    return s, worker


@pytest.mark.parametrize("state", ["waiting", "prefill", "decode", "preempted"])
def test_abort_in_any_state_frees_everything(state):
    s, worker = _to_state(state)
    x = s.requests["x"]
    assert s.abort_requests(["x", "unknown"]) == ["x"]
    assert x.status == RequestStatus.FINISHED_ABORTED
    assert x.status.finish_reason == "abort"
    assert "x" not in s.requests and x not in s.running and x not in s.waiting
    assert s.kv.blocks_of("x") == []
    assert s.abort_requests(["x"]) == []  # already finished
    s.abort_requests(list(s.requests))
    assert free_all(s)
    sched = s.schedule()
    assert "x" in sched.finished_req_ids
    assert sched.total_num_scheduled_tokens == 0
    worker.execute(sched)
    assert worker.reqs == {}
    assert not s.has_unfinished_requests()
    assert s.schedule().finished_req_ids == set()  # reported once


def test_abort_one_of_many_leaves_the_others_running():
    s = make_scheduler(num_blocks=32, block_size=4, max_num_batched_tokens=16)
    for name in "abc":
        s.add_request(make_request(name, 6, max_tokens=5))
    step(s)
    used = {n: len(s.kv.blocks_of(n)) for n in "abc"}
    s.abort_requests(["b"])
    assert s.kv.pool.num_free_blocks == 32 - used["a"] - used["c"]
    sched, _ = step(s)
    assert sched.finished_req_ids == {"b"}
    assert list(sched.num_scheduled_tokens) == ["a", "c"]
    outputs = run_to_completion(s)
    assert set(outputs) == {"a", "c"}
    assert free_all(s)


def test_abort_while_the_step_runs_drops_its_output():
    s = make_scheduler()
    s.add_request(make_request("x", 4))
    sched = s.schedule()
    s.abort_requests(["x"])
    assert s.update_from_output(sched, ModelOutput(["x"], [[5]])) == []
    assert free_all(s)
    assert s.schedule().finished_req_ids == {"x"}


def test_finished_ids_are_reported_once_on_the_next_step():
    s = make_scheduler()
    s.add_request(make_request("a", 4, max_tokens=1))
    s.add_request(make_request("b", 4, max_tokens=3))
    _, outs = step(s)
    assert [(o.req_id, o.finish_reason) for o in outs] == [("a", "length"), ("b", None)]
    sched, _ = step(s)
    assert sched.finished_req_ids == {"a"}
    sched, _ = step(s)
    assert sched.finished_req_ids == set()
    assert s.schedule().finished_req_ids == {"b"}


# -- randomized simulation -----------------------------------------------------------------------

def check_invariants(s, sched, cfg, had_work):
    pool, kv = s.kv.pool, s.kv
    bs = kv.block_size
    assert sched.total_num_scheduled_tokens == sum(sched.num_scheduled_tokens.values())
    assert sched.total_num_scheduled_tokens <= cfg["max_num_batched_tokens"]
    assert all(n >= 1 for n in sched.num_scheduled_tokens.values())
    assert len(sched.num_scheduled_tokens) <= cfg["max_num_seqs"]
    assert len(s.running) <= cfg["max_num_seqs"]
    if had_work:
        assert sched.total_num_scheduled_tokens > 0, "no progress"

    # Blocks: only running requests hold any, each exactly what its computed tokens need.
    in_use = pool.num_blocks - pool.num_free_blocks
    assert 0 <= in_use <= pool.num_blocks
    owned = [b for table in kv.block_tables.values() for b in table]
    assert len(owned) == len(set(owned)) == in_use
    assert all(pool.ref_counts[b] == 1 for b in owned)
    assert sum(pool.ref_counts) == in_use
    assert set(kv.block_tables) == {r.req_id for r in s.running}
    for r in s.running:
        assert r.status == RequestStatus.RUNNING
        assert 0 < r.num_computed_tokens <= r.num_tokens
        assert len(kv.blocks_of(r.req_id)) == cdiv(r.num_computed_tokens, bs)
    for r in s.waiting:
        assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert r.num_computed_tokens == 0
    assert len(s.running) + len(s.waiting) == len(s.requests)
    keys = [r.sort_key() for r in s.waiting]
    assert keys == sorted(keys)
    keys = [r.sort_key() for r in s.running]
    assert keys == sorted(keys)

    for req_id in sched.preempted_req_ids:
        r = s.requests[req_id]
        assert r.status == RequestStatus.PREEMPTED and r in s.waiting
        assert req_id not in sched.num_scheduled_tokens
    if cfg.get("scheduling_policy", "fcfs") == "fcfs" and sched.preempted_req_ids:
        assert not sched.new_requests
    assert not (sched.preempted_req_ids & {n.req_id for n in sched.new_requests})
    for new in sched.new_requests:
        r = s.requests[new.req_id]
        assert new.token_ids == r.all_token_ids
        assert new.num_prompt_tokens == r.num_prompt_tokens
        assert new.num_computed_tokens == 0
        assert new.block_ids == kv.blocks_of(new.req_id)
        assert r.num_computed_tokens == sched.num_scheduled_tokens[new.req_id]


def simulate(seed: int, abort_prob: float = 0.0, num_requests: int = 40,
             scheduling_policy: str = "fcfs", priority_aging_steps: int = 0):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.choice([24, 40, 64])
    num_blocks = cdiv(max_model_len, block_size) + rng.randint(0, 6)  # tight: forces preemption
    cfg = {"max_num_seqs": rng.randint(1, 8), "max_num_batched_tokens": rng.randint(4, 48),
           "scheduling_policy": scheduling_policy}
    s = make_scheduler(num_blocks, block_size, cfg["max_num_seqs"],
                       cfg["max_num_batched_tokens"], max_model_len,
                       scheduling_policy=scheduling_policy,
                       priority_aging_steps=priority_aging_steps)

    # What each request will see: at output position `at`, the worker emits `token`.
    plans, expected = {}, {}

    def make(i):
        req_id = f"r{i}"
        prompt_len = rng.randint(1, max_model_len - 1)
        max_tokens = rng.randint(1, 40)
        min_tokens = rng.choice([0, 0, rng.randint(0, max_tokens)])
        kind = rng.choice(["none", "eos", "stop_token", "ignore_eos"])
        at = rng.randint(0, 45)
        params = {"min_tokens": min_tokens}
        if kind == "stop_token":
            params["stop_token_ids"] = [STOP]
        if kind == "ignore_eos":
            params["ignore_eos"] = True
        token = STOP if kind == "stop_token" else EOS
        plans[req_id] = (at, token if kind != "none" else token_at(at))
        cap = min(max_tokens, max_model_len - prompt_len)
        if kind in ("eos", "stop_token") and at < cap and at + 1 >= min_tokens:
            expected[req_id] = (at + 1, "stop", STOP if kind == "stop_token" else None)
        else:
            expected[req_id] = (cap, "length", None)
        return make_request(req_id, prompt_len, max_tokens, priority=rng.choice([0, 0, 1, 2]),
                            **params)

    def token_fn(req_id, index):
        at, token = plans[req_id]
        return token if index == at else token_at(index)

    worker = FakeWorker(block_size, token_fn)
    tokens: dict[str, list[int]] = {}
    finals: dict[str, tuple] = {}
    aborted: set[str] = set()
    finished_pending: set[str] = set()  # finished, not yet reported in finished_req_ids
    reported: set[str] = set()
    added = 0
    steps = 0
    while added < num_requests or s.has_unfinished_requests():
        steps += 1
        assert steps < 5000, "simulation did not finish"
        if added < num_requests and rng.random() < 0.4:
            for _ in range(rng.randint(1, 3)):
                if added < num_requests:
                    s.add_request(make(added))
                    added += 1
        if abort_prob and s.requests and rng.random() < abort_prob:
            victim = rng.choice(sorted(s.requests))
            assert s.abort_requests([victim]) == [victim]
            aborted.add(victim)
            finished_pending.add(victim)

        had_work = s.has_unfinished_requests()
        sched = s.schedule()
        assert sched.finished_req_ids == finished_pending
        assert not (sched.finished_req_ids & reported)
        reported |= sched.finished_req_ids
        finished_pending = set()
        check_invariants(s, sched, cfg, had_work)

        out = worker.execute(sched)
        for o in s.update_from_output(sched, out):
            assert o.req_id not in finals
            assert len(o.new_token_ids) == 1
            tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                finals[o.req_id] = (o.finish_reason, o.stop_reason)
                finished_pending.add(o.req_id)
                assert o.req_id not in s.requests
        for req_id in sched.num_scheduled_tokens:
            if req_id in s.requests:
                state = worker.reqs[req_id]  # its sampled token comes back in the next delta
                assert state.token_ids + state.sampled == s.requests[req_id].all_token_ids

    sched = s.schedule()
    assert sched.finished_req_ids == finished_pending
    reported |= sched.finished_req_ids
    assert reported == {f"r{i}" for i in range(num_requests)}
    assert free_all(s) and not s.running and not s.waiting
    worker.execute(sched)
    assert worker.reqs == {}

    for i in range(num_requests):
        req_id = f"r{i}"
        if req_id in aborted:
            assert req_id not in finals
            continue
        n, reason, stop_reason = expected[req_id]
        assert finals[req_id] == (reason, stop_reason), req_id
        assert reason in ("stop", "length")
        assert tokens[req_id] == [token_fn(req_id, j) for j in range(n)], req_id
    return s, steps


@pytest.mark.parametrize("seed", range(12))
def test_random_simulation_respects_budgets_and_finishes_everything(seed):
    s, steps = simulate(seed)
    assert steps >= 10


def test_random_simulations_do_preempt():
    preemptions = [simulate(seed)[0].num_preemptions for seed in range(12)]
    assert sum(p > 0 for p in preemptions) >= 8, preemptions


@pytest.mark.parametrize("seed", range(100, 106))
def test_random_simulation_with_aborts(seed):
    simulate(seed, abort_prob=0.15)
