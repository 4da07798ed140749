"""Pooling requests in the scheduler: a prompt is scheduled whole in one step (it waits for a
step with room for all of it, while chunked generation goes on), never from the prefix cache
nor into it, and finishes with its vector after that one step."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from octavo.core.contract import ModelOutput
from octavo.pooling_params import PoolingParams
from tests.core.fakes import make_request, make_scheduler


def _pooling(req_id: str, prompt_len: int):
    return replace(make_request(req_id, prompt_len, max_tokens=1),
                   pooling_params=PoolingParams())


def test_a_pooling_request_runs_whole_in_one_step_and_finishes_with_its_vector():
    s = make_scheduler(max_num_batched_tokens=32, enable_caching=True)
    s.add_request(make_request("gen", 24, max_tokens=4))
    s.add_request(_pooling("emb", 20))
    first = s.schedule()
    # 24 generation tokens leave 8: the 20-token prompt waits rather than take a chunk
    assert first.num_scheduled_tokens == {"gen": 24}
    s.update_from_output(first, ModelOutput(["gen"], [[7]]))
    second = s.schedule()
    assert second.num_scheduled_tokens == {"gen": 1, "emb": 20}
    assert second.new_requests[0].pooling_params == PoolingParams()
    vector = np.arange(4, dtype=np.float32)
    outs = s.update_from_output(second, ModelOutput(
        ["gen", "emb"], [[8], []], pooled={"emb": vector}))
    emb = next(o for o in outs if o.req_id == "emb")
    assert emb.finish_reason == "stop" and emb.new_token_ids == []
    assert np.array_equal(emb.pooled, vector)
    assert "emb" not in s.requests and "emb" in s.schedule().finished_req_ids
    # the same prompt again: nothing from the prefix cache (pooling reads every position)
    s.add_request(_pooling("emb2", 20))
    again = s.schedule()
    assert again.num_scheduled_tokens["emb2"] == 20
    assert again.new_requests[-1].num_computed_tokens == 0
