"""Speculative decoding in the core, with fake requests: n-gram drafts, the 1 + k scheduling,
the rollback of rejected positions, limits (max_tokens, budget, max_model_len), the counters, and
no leaked blocks."""
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
    with pytest.raises(NotImplementedError, match="draft_model"):
        SpeculativeConfig.parse({"method": "draft_model", "model": "x"})
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
