"""Structured output in the core, with a fake grammar backend (no xgrammar, no torch): requests
wait while their grammar compiles, the bitmask covers exactly the constrained requests that
sample, matchers follow every token (chunked prefill, preemption), an ended grammar stops the
request, and a failed compile aborts only its request."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from octavo.config import EngineConfig
from octavo.core.contract import ModelOutput, SchedulerOutput
from octavo.core.engine_core import EngineCore
from octavo.core.structured import StructuredOutputManager
from octavo.executor.base import Executor
from octavo.params import ReasoningEndRule, StructuredOutputsParams
from tests.core.core_requests import submit
from tests.core.fakes import EOS, FakeWorker, make_request

VOCAB = 2048


class ChoiceMatcher:
    """Matches one of several token sequences, then EOS."""

    def __init__(self, seqs: list[list[int]]) -> None:
        self.seqs = seqs
        self.prefix: list[int] = []
        self.terminated = False

    def allowed(self) -> set[int]:
        n = len(self.prefix)
        out = {s[n] for s in self.seqs if len(s) > n and s[:n] == self.prefix}
        if self.prefix in self.seqs:
            out.add(EOS)
        return out

    def accept_token(self, token_id: int) -> bool:
        if self.terminated or token_id not in self.allowed():
            return False
        if token_id == EOS:
            self.terminated = True
        else:
            self.prefix.append(token_id)
        return True

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> None:
        bits = np.zeros(bitmask.shape[1] * 32, np.uint8)
        bits[list(self.allowed())] = 1
        bitmask[index] = np.packbits(bits, bitorder="little").view(np.int32)

    def is_terminated(self) -> bool:
        return self.terminated

    def rollback(self, num_tokens: int) -> None:
        for _ in range(num_tokens):
            if self.terminated:
                self.terminated = False
            else:
                self.prefix.pop()


class FakeBackend:
    """choice: each string's characters are its token ids; regex "fail" does not compile; a
    compile waits for `gate` when one is set."""

    vocab_size = VOCAB

    def __init__(self) -> None:
        self.compiles: list[tuple] = []
        self.gate: threading.Event | None = None

    def compile(self, spec: StructuredOutputsParams) -> list[list[int]]:
        if self.gate is not None:
            assert self.gate.wait(10)
        self.compiles.append(spec.key())
        if spec.regex == "fail":
            raise ValueError("no such grammar")
        return [[ord(c) for c in s] for s in spec.choice]

    def matcher(self, compiled: list[list[int]]) -> ChoiceMatcher:
        return ChoiceMatcher(compiled)

    def memory_bytes(self, compiled: list[list[int]]) -> int:
        return 100 * sum(len(s) for s in compiled)


def allowed_tokens(row: np.ndarray) -> list[int]:
    return np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist()


class GrammarExecutor(Executor):
    """The fake worker, except that constrained rows sample the lowest (or highest) token the
    bitmask allows."""

    def __init__(self, num_blocks: int, highest: bool = False) -> None:
        self.num_blocks = num_blocks
        self.highest = highest
        self.steps: list[SchedulerOutput] = []

    def init_kv_cache(self, kv_cache_memory: int, block_size: int) -> int:
        self.worker = FakeWorker(block_size)
        return self.num_blocks

    def execute(self, sched: SchedulerOutput) -> ModelOutput:
        self.steps.append(sched)
        out = self.worker.execute(sched)
        sampling = {rid for rid, s in zip(out.req_ids, out.sampled_token_ids) if s}
        grammar = sched.grammar
        if grammar is not None:
            assert grammar.bitmask.dtype == np.int32
            assert grammar.bitmask.shape == (len(grammar.req_ids), VOCAB // 32)
            assert set(grammar.req_ids) <= sampling  # a row only for a request that samples
            for i, rid in enumerate(grammar.req_ids):
                allowed = allowed_tokens(grammar.bitmask[i])
                tok = allowed[-1] if self.highest else allowed[0]
                j = out.req_ids.index(rid)
                out.sampled_token_ids[j] = [tok]
                self.worker.reqs[rid].sampled = [tok]
        return out


def make_core(backend: FakeBackend | None, num_blocks: int = 64, highest: bool = False,
              max_model_len: int = 128, **sched) -> tuple[EngineCore, GrammarExecutor]:
    config = EngineConfig.from_kwargs(block_size=4, kv_cache_memory=1, **sched)
    executor = GrammarExecutor(num_blocks, highest)
    factory = None if backend is None else (lambda: backend)
    return EngineCore(config, executor, max_model_len, grammar_backend=factory), executor


def choice(*options: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=list(options))


def run(core: EngineCore, max_steps: int = 500) -> dict[str, list]:
    """Step until done; request id -> [token ids, finish reason, stop reason]."""
    done: dict[str, list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests():
            return done
        for o in core.step():
            entry = done.setdefault(o.req_id, [[], None, None])
            entry[0] += o.new_token_ids
            if o.finish_reason:
                entry[1], entry[2] = o.finish_reason, o.stop_reason
    raise AssertionError("requests did not finish")


def text(tokens: list[int]) -> str:
    return "".join(chr(t) for t in tokens if t != EOS)


def test_output_follows_the_grammar_and_stops_at_its_end():
    core, _ = make_core(FakeBackend())
    submit(core, make_request("a", 5, structured_outputs=choice("yes", "no")))
    submit(core, make_request("b", 5, structured_outputs=choice("yes", "no"),
                              ignore_eos=True))  # an ended grammar stops it all the same
    submit(core, make_request("free", 5, max_tokens=6))
    done = run(core)
    assert text(done["a"][0]) == "no" and done["a"][0][-1] == EOS and done["a"][1] == "stop"
    assert text(done["b"][0]) == "no" and done["b"][1] == "stop"
    assert done["free"][0] == [1000 + i for i in range(6)]  # the unconstrained one is untouched


def test_highest_token_path_and_max_tokens_cut():
    core, _ = make_core(FakeBackend(), highest=True)
    submit(core, make_request("a", 3, structured_outputs=choice("yes", "no")))
    submit(core, make_request("cut", 3, max_tokens=2, structured_outputs=choice("yes")))
    done = run(core)
    assert text(done["a"][0]) == "yes" and done["a"][1] == "stop"
    assert done["cut"][0] == [ord("y"), ord("e")] and done["cut"][1] == "length"


def test_a_request_waits_while_its_grammar_compiles_and_others_run():
    backend = FakeBackend()
    backend.gate = threading.Event()
    core, ex = make_core(backend)
    submit(core, make_request("slow", 4, structured_outputs=choice("ok")))
    submit(core, make_request("free", 4, max_tokens=3))
    for _ in range(4):
        core.step()
    assert core.structured.is_compiling("slow")
    assert all("slow" not in s.num_scheduled_tokens for s in ex.steps)
    assert list(core.scheduler.requests) == ["slow"]  # "free" ran to its end meanwhile
    start = time.perf_counter()
    assert core.step() == []  # idle: waits a little for the compile instead of spinning
    assert 0.005 < time.perf_counter() - start < 1.0
    backend.gate.set()
    done = run(core)
    assert text(done["slow"][0]) == "ok" and done["slow"][1] == "stop"


def test_compiles_are_cached_by_key():
    backend = FakeBackend()
    core, _ = make_core(backend)
    for i in range(3):
        submit(core, make_request(f"r{i}", 4, structured_outputs=choice("ab", "c")))
    submit(core, make_request("other", 4, structured_outputs=choice("c", "ab")))
    run(core)
    submit(core, make_request("later", 4, structured_outputs=choice("ab", "c")))
    run(core)
    assert backend.compiles == [("choice", '["ab", "c"]', False), ("choice", '["c", "ab"]', False)]


def test_cache_keeps_the_most_recent_grammars_within_its_bounds():
    backend = FakeBackend()
    manager = StructuredOutputManager(lambda: backend, cache_size=3, cache_bytes=1000)

    def use(option: str) -> None:
        manager.add_request(make_request("r", 4, structured_outputs=choice(option)))
        while manager.has_compiling():
            manager.wait_for_compiles(5)
            assert manager.collect_compiled() == []
        manager.remove("r")

    for option in ["aa", "bb", "cc", "dd", "aa", "dd"]:
        use(option)
    # At most 3 entries: "dd" evicted "aa", which compiled again; "dd" was still cached.
    assert [k[1] for k in backend.compiles] == ['["aa"]', '["bb"]', '["cc"]', '["dd"]', '["aa"]']
    use("x" * 12)  # 1200 bytes once compiled: over the byte bound
    use("y")
    use("dd")
    assert [k[1] for k in backend.compiles][-3:] == ['["xxxxxxxxxxxx"]', '["y"]', '["dd"]']
    manager.shutdown()


def test_failed_compile_aborts_only_that_request():
    core, _ = make_core(FakeBackend())
    submit(core, make_request("bad", 4, structured_outputs=StructuredOutputsParams(
        regex="fail")))
    submit(core, make_request("good", 4, structured_outputs=choice("ok")))
    done = run(core)
    assert done["bad"] == [[], "abort", "structured_outputs: no such grammar"]
    assert text(done["good"][0]) == "ok"
    assert core.scheduler.kv.pool.num_free_blocks == core.scheduler.kv.pool.num_blocks


def test_no_backend_refuses_constrained_requests():
    core, _ = make_core(None)
    with pytest.raises(ValueError, match="structured_outputs"):
        submit(core, make_request("a", 4, structured_outputs=choice("x")))
    assert not core.has_unfinished_requests()


def test_chunked_prefill_gets_a_bitmask_only_on_its_last_chunk():
    core, ex = make_core(FakeBackend(), max_num_batched_tokens=8)
    submit(core, make_request("long", 30, structured_outputs=choice("hi")))
    done = run(core)
    assert text(done["long"][0]) == "hi"
    with_mask = [s for s in ex.steps if s.grammar is not None]
    assert [s.grammar.req_ids for s in with_mask] == [["long"]] * 3  # "h", "i", EOS
    first_sampling = next(s for s in ex.steps if s.grammar is not None)
    assert ex.steps.index(first_sampling) == 3  # 30 prompt tokens in chunks of 8


def test_preempted_request_resumes_its_grammar():
    # 6 blocks of 4 tokens: two requests growing past 12 tokens each cannot both stay.
    core, ex = make_core(FakeBackend(), num_blocks=6, max_model_len=24)
    long = "abcdefghij"
    submit(core, make_request("a", 8, max_tokens=12, structured_outputs=choice(long)))
    submit(core, make_request("b", 8, max_tokens=12, structured_outputs=choice(long)))
    done = run(core)
    assert core.scheduler.num_preemptions > 0
    for rid in ("a", "b"):
        assert text(done[rid][0]) == long and done[rid][1] == "stop"


def test_a_token_outside_the_grammar_aborts_the_request():
    core, ex = make_core(FakeBackend())
    submit(core, make_request("a", 4, structured_outputs=choice("xy")))
    core.structured.wait_for_compiles(5)
    assert core.scheduler.finish_failed_grammars() == []
    sched = core.scheduler.schedule()
    outs = core.scheduler.update_from_output(sched, ModelOutput(["a"], [[ord("z")]]))
    assert outs[0].finish_reason == "abort" and "outside" in outs[0].stop_reason
    assert not core.has_unfinished_requests()


def gated(rule: ReasoningEndRule, *options: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(choice=list(options), reasoning_end=rule)


def test_grammar_waits_until_reasoning_ends():
    # DeepSeek-R1 style: the fake worker's free tokens 1000, 1001, 1002 are reasoning; 1002 is
    # the end tag, so the grammar applies from the fourth token.
    core, ex = make_core(FakeBackend())
    submit(core, make_request("r1", 4, structured_outputs=gated(
        ReasoningEndRule(start_id=999, end_id=1002, start_required=False), "yes", "no")))
    done = run(core)
    assert done["r1"][0][:3] == [1000, 1001, 1002] and text(done["r1"][0][3:]) == "no"
    assert done["r1"][1] == "stop"
    masked = [s.grammar.req_ids if s.grammar else [] for s in ex.steps]
    assert masked == [[], [], [], ["r1"], ["r1"], ["r1"]]  # reasoning rows are free


def test_gate_that_requires_the_start_tag():
    # Qwen3 style: the first token may open reasoning (token 50 is the lowest allowed) or be
    # the grammar's; reasoning then runs to the end tag 1003.
    core, ex = make_core(FakeBackend())
    submit(core, make_request("think", 4, structured_outputs=gated(
        ReasoningEndRule(start_id=50, end_id=1003, start_required=True), "yes", "no")))
    done = run(core)
    assert done["think"][0][:4] == [50, 1001, 1002, 1003]
    assert text(done["think"][0][4:]) == "no" and done["think"][1] == "stop"
    first = ex.steps[0].grammar
    assert first.req_ids == ["think"] and allowed_tokens(first.bitmask[0]) == [50, ord("n"),
                                                                                 ord("y")]
    # Without reasoning the first token is already the grammar's (the highest allowed is "y").
    core, ex = make_core(FakeBackend(), highest=True)
    submit(core, make_request("direct", 4, structured_outputs=gated(
        ReasoningEndRule(start_id=50, end_id=1003, start_required=True), "yes", "no")))
    done = run(core)
    assert text(done["direct"][0]) == "yes" and done["direct"][1] == "stop"
    assert all(s.grammar is not None for s in ex.steps)


def test_reasoning_end_rule_in_the_prompt():
    rule = ReasoningEndRule(7, 8, start_required=True)
    assert rule.ended_in_prompt([1, 7, 3, 8, 4])      # an empty think block closed it
    assert not rule.ended_in_prompt([1, 8, 2, 7, 3])  # the template opened a new one
    assert not rule.ended_in_prompt([1, 2])
    with pytest.raises(ValueError, match="reasoning_end.end_id"):
        ReasoningEndRule(7, -1, False)


def test_a_compile_past_its_timeout_fails_only_its_request():
    backend = FakeBackend()
    backend.gate = threading.Event()  # the compile never finishes on its own
    core, _ = make_core(backend, grammar_compile_timeout=0.05)
    submit(core, make_request("stuck", 4, structured_outputs=choice("ok")))
    submit(core, make_request("free", 4, max_tokens=3))
    done = run(core)
    assert done["stuck"][1] == "abort" and "did not compile within 0.05 s" in done["stuck"][2]
    assert done["free"][1] == "length"
    backend.gate.set()
    submit(core, make_request("again", 4, structured_outputs=choice("ok")))
    assert text(run(core)["again"][0]) == "ok"  # compiled anew, not the failed entry
