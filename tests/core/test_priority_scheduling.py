"""Scheduling policies: fcfs ignores priority; priority orders the queues, preempts running
requests of strictly lower priority for a waiting one short of blocks or seats, keeps a
preempted request's place, and ages waiting requests so that none starves."""
from __future__ import annotations

import argparse

import pytest

from octavo.config import EngineConfig, SchedulerConfig, add_engine_args
from octavo.core.request import RequestStatus
from tests.core.fakes import (
    make_request, make_scheduler, run_to_completion, simple_model_output, step, token_at)
from tests.core.test_scheduler import free_all, simulate


def admission_order(s, max_steps: int = 1000) -> list[str]:
    order = []
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return order
        sched, _ = step(s)
        order += [n.req_id for n in sched.new_requests]
    raise AssertionError("requests did not finish")


def collect(s, outputs: dict[str, list[int]], max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return
        _, outs = step(s)
        for o in outs:
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


# -- fcfs ----------------------------------------------------------------------------------------

def test_fcfs_is_the_default():
    assert SchedulerConfig().scheduling_policy == "fcfs"
    assert EngineConfig().scheduler.scheduling_policy == "fcfs"


def test_fcfs_ignores_priority_in_admission_and_batch_order():
    s = make_scheduler(max_num_seqs=1)
    prios = {"late-low": 2, "high": 0, "mid": 1, "high-2": 0, "neg": -5}
    for name, p in prios.items():
        s.add_request(make_request(name, 4, max_tokens=1, priority=p))
    assert [r.req_id for r in s.waiting] == list(prios)
    assert admission_order(s) == list(prios)

    s = make_scheduler(max_num_seqs=4)
    s.add_request(make_request("low", 4, max_tokens=5, priority=1))
    step(s)
    s.add_request(make_request("high", 4, max_tokens=5, priority=0))
    step(s)
    assert [r.req_id for r in s.running] == ["low", "high"]
    sched, _ = step(s)
    assert list(sched.num_scheduled_tokens) == ["low", "high"]


def test_fcfs_preempts_the_latest_whatever_its_priority():
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, max_model_len=24)
    for name, p in (("a", 3), ("b", 0), ("c", -1)):
        s.add_request(make_request(name, 8, max_tokens=4, priority=p))
    step(s)
    assert s.kv.pool.num_free_blocks == 0
    sched, _ = step(s)
    assert sched.preempted_req_ids == {"c"}  # under priority it would be "a"
    run_to_completion(s)
    assert free_all(s)


def test_fcfs_never_preempts_for_a_waiting_request():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("low", 4, max_tokens=6, priority=5))
    step(s)
    s.add_request(make_request("high", 4, max_tokens=2, priority=0))
    assert admission_order(s) == ["high"]  # only after "low" finished
    assert s.num_preemptions == 0


# -- priority: order -----------------------------------------------------------------------------

@pytest.mark.parametrize("aging", [0, 1000])
def test_priority_orders_admission(aging):
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", priority_aging_steps=aging)
    prios = {"late-low": 2, "high": 0, "mid": 1, "high-2": 0, "neg": -5, "mid-2": 1}
    for name, p in prios.items():
        s.add_request(make_request(name, 4, max_tokens=1, priority=p))
    expected = ["neg", "high", "high-2", "mid", "mid-2", "late-low"]
    assert [r.req_id for r in s.waiting] == expected
    assert admission_order(s) == expected


# -- priority: preemption for a waiting request --------------------------------------------------

def test_high_priority_arrival_preempts_when_blocks_run_out():
    # 7 blocks of 4: l1 and l2 (12-token prompts) hold 3 each; h needs 2.
    s = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=64,
                       max_model_len=28, scheduling_policy="priority")
    s.add_request(make_request("l1", 12, max_tokens=6, priority=1))
    s.add_request(make_request("l2", 12, max_tokens=6, priority=1))
    outputs: dict[str, list[int]] = {}
    sched, _ = step(s)
    assert len(sched.new_requests) == 2 and s.kv.pool.num_free_blocks == 1
    s.add_request(make_request("h", 8, max_tokens=3, priority=0))
    sched = s.schedule()
    assert sched.preempted_req_ids == {"l2"}  # the lowest priority, latest
    assert [n.req_id for n in sched.new_requests] == ["h"]  # admitted in the same step
    assert list(sched.num_scheduled_tokens) == ["l1", "h"]
    assert "l2" not in sched.num_scheduled_tokens
    s.update_from_output(sched, simple_model_output(s, sched))
    l2 = s.requests["l2"]
    assert l2.status == RequestStatus.PREEMPTED and l2.num_preemptions == 1
    assert l2.output_token_ids == [token_at(0)]
    # l2 resumes from scratch (recompute) and ends with its full output, the same tokens.
    resumed = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        sched, outs = step(s)
        resumed += [n for n in sched.new_requests if n.req_id == "l2"]
        for o in outs:
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    (new,) = resumed
    assert new.num_computed_tokens == 0 and len(new.token_ids) == 13
    assert l2.output_token_ids == [token_at(i) for i in range(6)]
    assert len(outputs["l2"]) == 5  # plus the one sent before the preemption
    assert s.num_preemptions == 1
    assert free_all(s)


def test_high_priority_arrival_preempts_when_seats_run_out():
    s = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    s.add_request(make_request("mid", 4, max_tokens=8, priority=1))
    s.add_request(make_request("low", 4, max_tokens=8, priority=2))
    step(s)
    step(s)
    s.add_request(make_request("high", 4, max_tokens=3, priority=0))
    sched, _ = step(s)
    assert sched.preempted_req_ids == {"low"}
    assert [n.req_id for n in sched.new_requests] == ["high"]
    assert [r.req_id for r in s.running] == ["high", "mid"]
    low = s.requests["low"]
    assert low.status == RequestStatus.PREEMPTED
    assert low.output_token_ids == [token_at(0), token_at(1)]
    run_to_completion(s)
    assert low.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert low.output_token_ids == [token_at(i) for i in range(8)]
    assert s.num_preemptions == 1
    assert free_all(s)


@pytest.mark.parametrize("running, waiting", [
    ({"a": 1, "b": 1}, 1),  # equal priority
    ({"a": 0, "b": 1}, 1),  # one higher, one equal
    ({"a": 0, "b": 0}, 1),  # both higher
])
@pytest.mark.parametrize("short_of", ["seats", "blocks"])
def test_never_preempts_equal_or_higher_priority(running, waiting, short_of):
    if short_of == "seats":
        s = make_scheduler(max_num_seqs=2, scheduling_policy="priority")
    else:  # 6 blocks of 4: the two running 10-token prompts hold them all (and room for 2 more)
        s = make_scheduler(num_blocks=6, block_size=4, max_num_seqs=8, max_model_len=24,
                           scheduling_policy="priority")
    plen = 4 if short_of == "seats" else 10
    for name, p in running.items():
        s.add_request(make_request(name, plen, max_tokens=2, priority=p))
    step(s)
    assert len(s.running) == 2
    s.add_request(make_request("w", 4, max_tokens=2, priority=waiting))
    sched, _ = step(s)
    assert not sched.preempted_req_ids and not sched.new_requests
    assert s.requests["w"].status == RequestStatus.WAITING
    assert admission_order(s) == ["w"]  # once a and b finished
    assert s.num_preemptions == 0
    assert free_all(s)


def test_preempts_none_when_all_victims_would_not_make_room():
    # 8 blocks of 4; "high" holds 3, "low" 3, 2 free; "urgent" needs 8: even with "low"'s 3
    # blocks it would not fit ("high" is no victim: higher than "urgent"), so "low" keeps running.
    s = make_scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64,
                       scheduling_policy="priority")
    s.add_request(make_request("high", 12, max_tokens=2, priority=0))
    s.add_request(make_request("low", 12, max_tokens=2, priority=5))
    step(s)
    s.add_request(make_request("urgent", 30, max_tokens=1, priority=1))
    sched, _ = step(s)
    assert not sched.preempted_req_ids
    assert set(sched.num_scheduled_tokens) == {"high", "low"}
    run_to_completion(s)
    assert s.num_preemptions == 0
    assert free_all(s)


def test_preempts_several_lowest_first_until_it_fits():
    # 9 blocks of 4: three 12-token prompts hold all; "h" (20 tokens) needs 5: two victims.
    s = make_scheduler(num_blocks=9, block_size=4, max_num_batched_tokens=64,
                       scheduling_policy="priority")
    for name, p in (("p1", 1), ("p3", 3), ("p2", 2)):
        s.add_request(make_request(name, 12, max_tokens=6, priority=p))
    step(s)
    assert s.kv.pool.num_free_blocks == 0
    s.add_request(make_request("h", 20, max_tokens=2, priority=0))
    sched, _ = step(s)
    assert sched.preempted_req_ids == {"p3", "p2"}
    assert [n.req_id for n in sched.new_requests] == ["h"]
    assert [r.req_id for r in s.waiting] == ["p2", "p3"]  # their places: priority order
    run_to_completion(s)
    assert free_all(s)


@pytest.mark.parametrize("aging", [0, 100])
def test_preempted_request_keeps_its_place_ahead_of_later_equal_priority_arrivals(aging):
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", priority_aging_steps=aging)
    s.add_request(make_request("p", 4, max_tokens=6, priority=1))
    step(s)
    step(s)
    s.add_request(make_request("q", 4, max_tokens=2, priority=1))  # arrives before p's preemption
    step(s)
    s.add_request(make_request("h", 4, max_tokens=2, priority=0))
    sched, _ = step(s)
    assert sched.preempted_req_ids == {"p"}
    assert [r.req_id for r in s.waiting] == ["p", "q"]
    s.add_request(make_request("r", 4, max_tokens=2, priority=1))  # arrives after it
    outputs: dict[str, list[int]] = {}
    order = []
    for _ in range(100):
        if not s.has_unfinished_requests():
            break
        sched, outs = step(s)
        order += [n.req_id for n in sched.new_requests]
        for o in outs:
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    assert order == ["p", "q", "r"]
    assert "p" not in s.requests  # finished
    assert len(outputs["p"]) == 6 - 3  # 3 tokens went out before the preemption
    assert s.num_preemptions == 1
    assert free_all(s)


# -- priority: aging -----------------------------------------------------------------------------

def _low_among_a_stream_of_high(aging: int, max_steps: int) -> tuple[int | None, object]:
    """max_num_seqs 1; "low" (priority 1) arrives first, then one priority-0 request a step,
    each taking 2 steps. Returns the step "low" was admitted at (None if never) and "low"."""
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", priority_aging_steps=aging)
    low = make_request("low", 4, max_tokens=5, priority=1)
    s.add_request(low)
    admitted_at = None
    for t in range(max_steps):
        s.add_request(make_request(f"h{t}", 4, max_tokens=2, priority=0))
        sched, _ = step(s)
        if any(n.req_id == "low" for n in sched.new_requests):
            assert admitted_at is None  # never preempted, so admitted once
            admitted_at = t
        if low.status.finished:
            break
    return admitted_at, low


def test_without_aging_a_low_priority_request_starves():
    admitted_at, low = _low_among_a_stream_of_high(aging=0, max_steps=300)
    assert admitted_at is None and low.status == RequestStatus.WAITING


@pytest.mark.parametrize("aging", [1, 4, 10])
def test_aging_lets_a_low_priority_request_run_within_a_bound(aging):
    admitted_at, low = _low_among_a_stream_of_high(aging, max_steps=300)
    # "low" ranks like a priority-0 arrival of step `aging`: the high ones that arrived before,
    # 2 steps each, go first.
    assert admitted_at is not None and admitted_at <= 2 * aging
    assert low.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert low.output_token_ids == [token_at(i) for i in range(5)]
    assert low.num_preemptions == 0  # once aged to their priority, the stream cannot preempt it


def test_effective_priority_improves_every_aging_steps():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority", priority_aging_steps=3)
    s.add_request(make_request("busy", 4, max_tokens=50, priority=-10))
    w = make_request("w", 4, max_tokens=1, priority=2)
    s.add_request(w)
    seen = []
    for _ in range(7):
        seen.append(s.effective_priority(w))
        step(s)
    assert seen == [2, 2, 2, 1, 1, 1, 0]
    s.add_request(make_request("fresh-0", 4, max_tokens=1, priority=0))
    s.add_request(make_request("fresh-1", 4, max_tokens=1, priority=1))
    # w has waited 7 steps: it ranks ahead of a priority-0 arrival.
    assert [r.req_id for r in s.waiting] == ["w", "fresh-0", "fresh-1"]


def test_aging_off_under_fcfs_and_zero():
    s = make_scheduler(scheduling_policy="priority", priority_aging_steps=0)
    w = make_request("w", 4, priority=3)
    s.add_request(w)
    for _ in range(5):
        s.schedule()
    assert s.effective_priority(w) == 3


# -- randomized --------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("aging", [0, 5])
def test_random_simulation_under_the_priority_policy(seed, aging):
    s, steps = simulate(seed, abort_prob=0.1 if seed % 2 else 0.0,
                        scheduling_policy="priority", priority_aging_steps=aging)
    assert steps >= 10


def test_priority_preemption_with_the_prefix_cache_keeps_every_kv_right(monkeypatch):
    """Seeded workloads of test_prefix_cache's kind under the priority policy: the worker checks
    that every request reads back its own KV, with and without caching, and that both give the
    same tokens, while waiting requests do preempt running ones."""
    import random

    from octavo.core.scheduler import Scheduler
    from tests.core.test_prefix_cache import compare_runs, seeded_workload

    made_room = []
    original = Scheduler._preempt_for_priority

    def counting(self):
        victims = original(self)
        made_room.append(len(victims))
        return victims

    monkeypatch.setattr(Scheduler, "_preempt_for_priority", counting)
    for seed in range(8):
        cfg, ops = seeded_workload(random.Random(seed), add_below=0.45, step_below=0.95,
                                   priorities=(-1, 2), scheduling_policy="priority",
                                   priority_aging_steps=random.Random(seed).choice([0, 4]))
        compare_runs(cfg, ops, drain=True)
    assert sum(made_room) >= 4, made_room


# -- configuration -------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, name", [
    ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ({"scheduling_policy": "PRIORITY"}, "scheduling_policy"),
    ({"priority_aging_steps": -1}, "priority_aging_steps"),
])
def test_invalid_config_raises_naming_the_field(kwargs, name):
    with pytest.raises(ValueError, match=name):
        SchedulerConfig(**kwargs)
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_kwargs(**kwargs)


def test_flags_are_derived_from_the_fields():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = EngineConfig.from_cli(parser.parse_args([]))
    assert (cfg.scheduler.scheduling_policy, cfg.scheduler.priority_aging_steps) == ("fcfs", 1000)
    args = parser.parse_args(["--scheduling-policy", "priority", "--priority-aging-steps", "50"])
    cfg = EngineConfig.from_cli(args)
    assert (cfg.scheduler.scheduling_policy, cfg.scheduler.priority_aging_steps) == ("priority", 50)
    with pytest.raises(SystemExit):
        parser.parse_args(["--scheduling-policy", "lifo"])
