"""The scheduler's LoRA rule: the running requests use at most max_loras adapters (the worker's
slots); a request of another adapter waits while others run, and blocks of different adapters
are never shared by the prefix cache."""
from __future__ import annotations

import pytest

from octavo.core.request import RequestStatus
from octavo.params import LoRARequest
from tests.core.fakes import make_request, make_scheduler, run_to_completion, step


def _with_adapter(req, lora_id: int):
    if lora_id:
        req.lora_request = LoRARequest(f"a{lora_id}", lora_id, f"/adapters/{lora_id}")
    return req


def test_requests_of_another_adapter_wait_for_a_free_slot():
    s = make_scheduler(max_loras=2)
    ids = {"r1": 1, "r2": 2, "r3": 3, "base": 0, "r1b": 1}
    for req_id, lora in ids.items():
        s.add_request(_with_adapter(make_request(req_id, 5, max_tokens=4), lora))
    sched, _ = step(s)
    # adapter 3 would be a third: it waits; later requests of adapters 1 and none run
    assert set(sched.num_scheduled_tokens) == {"r1", "r2", "base", "r1b"}
    assert s.requests["r3"].status == RequestStatus.WAITING
    sent = {n.req_id: n.lora_request for n in sched.new_requests}
    assert sent["r1"].lora_int_id == 1 and sent["base"] is None
    r3_ran = False
    while s.has_unfinished_requests():
        sched, _ = step(s)
        adapters = {ids[r] for r in sched.num_scheduled_tokens} - {0}
        assert len(adapters) <= 2
        r3_ran |= "r3" in sched.num_scheduled_tokens
    assert r3_ran  # once adapter 2's last request left
    assert not s.requests


def test_an_adapter_without_lora_is_refused():
    s = make_scheduler()
    with pytest.raises(ValueError, match="without LoRA"):
        s.add_request(_with_adapter(make_request("a", 5), 1))
    assert not s.requests and not s.waiting


def test_prefix_cache_is_shared_within_an_adapter_only():
    s = make_scheduler(enable_caching=True, block_size=4, max_loras=4)
    for req_id, lora in [("base", 0), ("a1", 1), ("a2", 2)]:
        s.add_request(_with_adapter(make_request(req_id, 17, max_tokens=1), lora))
    run_to_completion(s)
    hits = {}
    for req_id, lora in [("base2", 0), ("a1-again", 1), ("a2-again", 2), ("a3", 3)]:
        s.add_request(_with_adapter(make_request(req_id, 17, max_tokens=1), lora))
        _, outs = step(s)
        hits[req_id] = next(o.num_cached_tokens for o in outs if o.req_id == req_id)
    # the same adapter (or none) finds its four full blocks; adapter 3 finds none of theirs
    assert hits == {"base2": 16, "a1-again": 16, "a2-again": 16, "a3": 0}
