"""allowed_token_ids and bad_words in the core (no torch): the token mask's rows, bad words
matched against the generated tail (drafts included), the intersection with a grammar, and a
request whose mask leaves nothing to sample stopped alone."""
from __future__ import annotations

import numpy as np
import pytest

from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.engine_core import EngineCore
from octavo.core.structured import StructuredOutputManager
from octavo.core.token_mask import TokenMask, clear_bits, packed_row
from tests.core.core_requests import submit
from tests.core.fakes import EOS, make_request
from tests.core.test_structured import (
    VOCAB, FakeBackend, GrammarExecutor, allowed_tokens, choice, run, text)

WORDS = VOCAB // 32


class MaskExecutor(GrammarExecutor):
    """Masked rows sample their highest allowed token (or lowest); a row that allows nothing
    samples token 0, as an argmax over all -inf would."""

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.steps.append(sched)
        out = self.worker.execute(sched)
        grammar = sched.grammar
        if grammar is not None:
            for i, rid in enumerate(grammar.req_ids):
                allowed = allowed_tokens(grammar.bitmask[i])
                tok = (allowed[-1] if self.highest else allowed[0]) if allowed else 0
                out.sampled_token_ids[out.req_ids.index(rid)] = [tok]
                self.worker.reqs[rid].sampled = [tok]
        return out


def make_core(backend=None, highest=True, vocab_size=VOCAB):
    config = EngineConfig.from_kwargs(block_size=4, kv_cache_memory=1)
    executor = MaskExecutor(64, highest)
    factory = None if backend is None else (lambda: backend)
    core = EngineCore(config, executor, 128, grammar_backend=factory, vocab_size=vocab_size)
    return core, executor


def masked(req_id, bad_words=(), **params):
    req = make_request(req_id, 5, **params)
    req.bad_words_token_ids = [list(w) for w in bad_words]
    return req


def test_packed_rows_and_cleared_bits():
    row = packed_row([0, 31, 32, 2047], WORDS)
    assert allowed_tokens(row) == [0, 31, 32, 2047]
    clear_bits(row, [31, 31, 2047])
    assert allowed_tokens(row) == [0, 32]


def test_bad_words_match_only_the_generated_tail():
    mask = TokenMask(None, [[9], [4, 5, 6], [7, 8]], WORDS)
    assert mask.banned([]) == [9]  # a one-token word is always banned
    assert mask.banned([1, 4, 5]) == [9, 6]
    assert mask.banned([4]) == [9]  # 4, 5 must both precede 6
    assert mask.banned([1, 4], [5]) == [9, 6]  # a verified draft counts as output
    assert mask.banned([7]) == [9, 8]
    row = np.full(WORDS, -1, np.int32)
    mask.apply(row, [4, 5])
    assert 6 not in allowed_tokens(row) and 9 not in allowed_tokens(row)
    assert len(allowed_tokens(row)) == VOCAB - 2
    assert mask.refusal(6, [4, 5]) is not None and mask.refusal(6, [5, 5]) is None


def test_allowed_token_ids_restrict_every_step():
    core, ex = make_core()
    submit(core, masked("a", allowed_token_ids=[300, 301, 900], max_tokens=6))
    submit(core, make_request("free", 5, max_tokens=6))
    done = run(core)
    assert done["a"][0] == [900] * 6  # the highest allowed, every step
    assert done["free"][0] == [1000, 1001, 1002, 1003, 1004, 1005]
    rows = [s.grammar.req_ids for s in ex.steps if s.grammar is not None]
    assert rows == [["a"]] * 6  # the unconstrained request gets no row


def test_bad_words_never_complete():
    core, _ = make_core()
    # highest allowed: 12 is banned alone; 11 may not follow 11
    submit(core, masked("a", bad_words=[[12], [11, 11]], allowed_token_ids=[10, 11, 12],
                        max_tokens=6))
    done = run(core)
    assert done["a"][0] == [11, 10, 11, 10, 11, 10]
    core, _ = make_core()
    submit(core, masked("b", allowed_token_ids=[10, 11, 12], max_tokens=3))
    assert run(core)["b"][0] == [12, 12, 12]  # without bad words


def test_token_mask_intersects_the_grammar():
    core, _ = make_core(FakeBackend(), highest=False)
    submit(core, masked("g", structured_outputs=choice("ax", "bx")))
    submit(core, masked("both", structured_outputs=choice("ax", "bx"),
                        allowed_token_ids=[ord("b"), ord("x"), EOS]))
    submit(core, masked("bad", structured_outputs=choice("ax", "bx"),
                        bad_words=[[ord("a")]]))
    done = run(core)
    assert text(done["g"][0]) == "ax"  # the lowest token the grammar allows
    assert text(done["both"][0]) == "bx" and done["both"][1] == "stop"
    assert text(done["bad"][0]) == "bx" and done["bad"][1] == "stop"


def test_a_mask_that_leaves_nothing_stops_only_that_request():
    core, _ = make_core()
    submit(core, masked("a", allowed_token_ids=[10], bad_words=[[10, 10]], max_tokens=5))
    submit(core, make_request("other", 5, max_tokens=3))
    done = run(core)
    assert done["a"][0] == [10, 0] and done["a"][1] == "abort"
    assert "allowed_token_ids" in done["a"][2]
    assert done["other"][1] == "length"


def test_drafts_get_rows_after_each_verified_draft():
    manager = StructuredOutputManager(None, vocab_size=VOCAB)
    req = masked("a", bad_words=[[5, 6]])
    req.output_token_ids = [1, 2]
    manager.add_request(req)
    req.num_computed_tokens = req.num_tokens
    sched = SchedulerOutput([], [], {"a": 3}, 3, spec_token_ids={"a": [5, 6]})
    grammar = manager.bitmask_for(sched, {"a": req})
    assert grammar.req_ids == ["a", "a", "a"]
    assert 6 in allowed_tokens(grammar.bitmask[0])  # after 1, 2
    assert 6 not in allowed_tokens(grammar.bitmask[1])  # after the draft 5
    assert 6 in allowed_tokens(grammar.bitmask[2])  # after 5, 6


def test_a_core_without_the_vocabulary_size_refuses_token_masks():
    core, _ = make_core(vocab_size=None)
    with pytest.raises(ValueError, match="allowed_token_ids"):
        submit(core, masked("a", allowed_token_ids=[3]))
    with pytest.raises(ValueError, match="bad_words"):
        submit(core, masked("b", bad_words=[[3]]))
    assert not core.has_unfinished_requests()
