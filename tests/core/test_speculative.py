"""Speculative decoding in the core, with fake requests: n-gram drafts, the 1 + k scheduling,
the rollback of rejected positions, limits (max_tokens, budget, max_model_len), the counters, and
no leaked blocks; draft-model drafts from the worker's output and their lookahead slots; grammar
masking of drafts (valid prefix, one bitmask row per verified position)."""
from __future__ import annotations

import json

import pytest

from octavo.config import EngineConfig, SpeculativeConfig
from octavo.core.contract import ModelOutput
from octavo.core.ngram import NgramProposer
from tests.core.fakes import make_request, make_scheduler


def test_ngram_proposes_what_followed_the_latest_longest_match():
    p = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3,
                                        prompt_lookup_min=2))
    assert p.propose([1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 2, 3], 10) == [6, 7, 2]  # latest match
    assert p.propose([8, 2, 3, 4, 7, 2, 3, 5, 8, 2, 3], 10) == [4, 7, 2]  # 3-gram beats 2-gram
    assert p.propose([1, 2, 3, 4, 5, 1, 2], 1) == [3]
    assert p.propose([1, 2, 3, 4], 5) == []  # no repeat
    assert p.propose([5], 5) == []
    loop = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=2,
                                           prompt_lookup_min=2))
    # In a short loop the latest match has only 2 tokens after it; the earliest has all 4.
    assert loop.propose([5, 6, 5, 6, 5, 6], 10) == [5, 6, 5, 6]


def test_config_is_checked_and_parsed_from_json():
    cfg = EngineConfig.from_kwargs(speculative_config=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}))
    assert cfg.speculative.num_speculative_tokens == 5
    assert cfg.replace(max_num_seqs=2).speculative == cfg.speculative
    assert EngineConfig.from_kwargs().speculative is None
    for method in ("eagle", "eagle3", "medusa", "mtp"):
        with pytest.raises(ValueError, match="EAGLE-style heads"):
            SpeculativeConfig(method=method)
    draft = SpeculativeConfig.parse({"method": "draft_model", "model": "x",
                                     "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "x", 3)
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        SpeculativeConfig.parse({"method": "draft_model"})
    with pytest.raises(ValueError, match="speculative_config.model is only"):
        SpeculativeConfig(model="x")
    with pytest.raises(ValueError, match="speculative_config.method must be"):
        SpeculativeConfig(method="lookahead")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="unknown field"):
        SpeculativeConfig.parse('{"method": "ngram", "k": 3}')
    with pytest.raises(ValueError, match="num_speculative_tokens must be a int"):
        SpeculativeConfig.parse({"num_speculative_tokens": "4"})
    with pytest.raises(ValueError, match="JSON object"):
        SpeculativeConfig.parse("{bad")


def _spec_scheduler(k=3, **kw):
    s = make_scheduler(**kw)
    s.proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=1,
                                                 prompt_lookup_max=2))
    return s


def _repeating(req_id, period=5, reps=4, **kw):
    req = make_request(req_id, 1, **kw)
    req.prompt_token_ids = [100 + i % period for i in range(period * reps)]
    return req


def test_drafts_are_scheduled_and_rejections_rolled_back():
    s = _spec_scheduler(k=3, num_blocks=16, block_size=4)
    req = _repeating("a", max_tokens=20)
    s.add_request(req)
    out = s.schedule()  # the prompt
    assert out.spec_token_ids == {}
    s.update_from_output(out, ModelOutput(["a"], [[100]]))  # continues the pattern
    out = s.schedule()
    assert out.spec_token_ids == {"a": [101, 102, 103]}
    assert out.num_scheduled_tokens == {"a": 4}
    assert req.num_computed_tokens == 20 + 4
    # First draft accepted, second rejected: 101 then the target's own 555.
    s.update_from_output(out, ModelOutput(["a"], [[101, 555]]))
    assert req.output_token_ids == [100, 101, 555]
    assert req.num_computed_tokens == req.num_tokens - 1  # positions of 102, 103 given back
    stats = s.stats()
    assert (stats.spec_draft_tokens, stats.spec_accepted_tokens, stats.spec_num_drafts) == (3, 1, 1)
    assert stats.spec_mean_acceptance_length == 2.0
    out = s.schedule()  # 555 never occurred before: no draft
    assert out.spec_token_ids == {} and out.num_scheduled_tokens == {"a": 1}
    s.abort_requests(["a"])
    assert s.kv.pool.num_free_blocks == 16  # nothing leaked


def test_drafts_respect_max_tokens_budget_and_eos_cut():
    s = _spec_scheduler(k=8, num_blocks=32, block_size=4, max_num_batched_tokens=64)
    req = _repeating("a", max_tokens=4)
    s.add_request(req)
    s.update_from_output(s.schedule(), ModelOutput(["a"], [[100]]))
    out = s.schedule()
    assert len(out.spec_token_ids["a"]) == 2  # 1 + 2 drafts + 1 bonus = max_tokens
    # An EOS in the middle of accepted tokens ends the request there.
    outs = s.update_from_output(out, ModelOutput(["a"], [[101, 2, 103]]))
    assert outs[0].new_token_ids == [101, 2] and outs[0].finish_reason == "stop"
    assert s.kv.pool.num_free_blocks == 32

    s = _spec_scheduler(k=8, num_blocks=32, block_size=4, max_num_batched_tokens=3)
    req = _repeating("b", reps=1, max_tokens=50)
    req.prompt_token_ids = [100, 101, 100]
    s.add_request(req)
    s.update_from_output(s.schedule(), ModelOutput(["b"], [[101]]))
    out = s.schedule()
    assert out.num_scheduled_tokens["b"] == 3 and len(out.spec_token_ids["b"]) == 2  # budget


def test_preemption_drops_drafts_and_blocks_return():
    s = _spec_scheduler(k=4, num_blocks=12, block_size=4, max_num_batched_tokens=64,
                        max_model_len=40)
    reqs = [_repeating(f"r{i}", period=3, reps=4, max_tokens=20) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    steps = 0
    while s.has_unfinished_requests() and steps < 200:
        out = s.schedule()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = s.requests[rid]
            drafts = out.spec_token_ids.get(rid, [])
            if req.num_computed_tokens < req.num_tokens:
                sampled.append([])
                continue
            # Accept half of the drafts, then a token of the pattern.
            keep = drafts[:len(drafts) // 2]
            sampled.append(keep + [100 + (req.num_tokens + len(keep)) % 3])
        s.update_from_output(out, ModelOutput(ids, sampled))
        steps += 1
    assert not s.has_unfinished_requests()
    assert s.num_preemptions > 0
    assert all(len(r.output_token_ids) == 20 for r in reqs)
    assert s.kv.pool.num_free_blocks == 12
    assert s.stats().spec_accepted_tokens > 0


def test_cli_flag_reaches_the_config():
    import argparse

    from octavo.config import add_engine_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 2}'])
    assert EngineConfig.from_cli(args).speculative == SpeculativeConfig(num_speculative_tokens=2)
    assert EngineConfig.from_cli(parser.parse_args([])).speculative is None
    with pytest.raises(ValueError, match="speculative_config.method"):
        EngineConfig.from_cli(parser.parse_args(["--speculative-config", '{"method": "eagle"}']))


def test_draft_model_drafts_come_from_the_output_with_lookahead_slots():
    s = make_scheduler(num_blocks=32, block_size=4, max_model_len=40)
    s.lookahead = 3
    req = make_request("a", 6, max_tokens=40)
    s.add_request(req)
    out = s.schedule()  # the prompt: it samples, so 3 lookahead slots past its 6 tokens
    assert out.spec_token_ids == {} and len(s.kv.blocks_of("a")) == 3  # 9 slots
    s.update_from_output(out, ModelOutput(["a"], [[50]], draft_token_ids={"a": [51, 52, 53]}))
    assert req.draft_token_ids == [51, 52, 53]
    out = s.schedule()
    assert out.spec_token_ids == {"a": [51, 52, 53]} and out.num_scheduled_tokens == {"a": 4}
    assert req.draft_token_ids == []  # used
    # 6 computed + 4 scheduled + 3 lookahead = 13 slots: 4 blocks
    assert len(s.kv.blocks_of("a")) == 4
    s.update_from_output(out, ModelOutput(["a"], [[51, 60]], draft_token_ids={"a": [61, 62]}))
    assert req.output_token_ids == [50, 51, 60] and req.num_computed_tokens == 8
    # A request not scheduled keeps its drafts; preemption drops them.
    s._preempt(s.running.pop())
    assert req.draft_token_ids == []
    out = s.schedule()  # recomputed from scratch: no drafts to verify
    assert out.spec_token_ids == {} and out.num_scheduled_tokens == {"a": 9}
    s.update_from_output(out, ModelOutput(["a"], [[70]], draft_token_ids={"a": [1, 2, 3]}))
    # Near max_model_len the drafts and the lookahead shrink to what is left.
    req.output_token_ids += [80] * (40 - 2 - req.num_tokens)
    req.num_computed_tokens = req.num_tokens - 1
    req.draft_token_ids = [1, 2, 3]
    out = s.schedule()
    assert out.spec_token_ids == {"a": [1]}  # room: 40 - 38 - 1
    assert len(s.kv.blocks_of("a")) * 4 >= 40 and len(s.kv.blocks_of("a")) == 10
    s.abort_requests(["a"])
    assert s.kv.pool.num_free_blocks == 32


def test_grammar_keeps_the_drafts_it_accepts_and_masks_each_position():
    from octavo.core.contract import SchedulerOutput
    from octavo.core.structured import StructuredOutputManager
    from octavo.params import StructuredOutputsParams
    from tests.core.test_structured import FakeBackend, allowed_tokens

    backend = FakeBackend()
    manager = StructuredOutputManager(lambda: backend)
    s = _spec_scheduler(k=3, num_blocks=16, block_size=4)
    s.structured = manager
    req = make_request("g", 4, max_tokens=10,
                       structured_outputs=StructuredOutputsParams(choice=["abcd", "abxy"]))
    s.add_request(req)
    manager.wait_for_compiles(5)
    assert s.finish_failed_grammars() == []
    a, b, c, d, x, z = (ord(ch) for ch in "abcdxz")
    assert s.structured.accept("g", a)
    assert manager.valid_prefix("g", [b, c, z]) == [b, c]
    assert manager.valid_prefix("g", [z]) == []
    assert manager.valid_prefix("g", [b, x, ord("y"), 2, 5]) == [b, x, ord("y"), 2]  # EOS ends it
    req.output_token_ids = [a]
    req.num_computed_tokens = req.num_tokens
    sched = SchedulerOutput([], [], {"g": 3}, 3, spec_token_ids={"g": [b, c]})
    mask = manager.bitmask_for(sched, {"g": req})
    assert mask.req_ids == ["g", "g", "g"]
    assert [allowed_tokens(row) for row in mask.bitmask] == [[b], [c, x], [d]]
    # The matcher is back where it was: only the real token a was accepted.
    assert manager.valid_prefix("g", [b]) == [b]
    assert allowed_tokens(manager.bitmask_for(
        SchedulerOutput([], [], {"g": 1}, 1), {"g": req}).bitmask[0]) == [b]
