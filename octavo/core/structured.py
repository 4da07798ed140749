"""Structured output in the core: grammars compiled off the step loop, one matcher per request,
and the token bitmask of each step.

The grammar library is reached only through `GrammarBackend`, which the layer that starts the
core provides (octavo/engine/grammar.py wraps xgrammar); the core itself never imports it nor
torch, and its bitmasks are numpy arrays. A request whose grammar is still compiling waits in
the scheduler, which skips it and runs the others, so a slow compile never stalls the loop.
Compiled grammars are cached by the grammar's key (a core serves one tokenizer, so the key of
the spec is the whole key); `n > 1` children and repeated schemas compile once.

A spec with a `reasoning_end` rule is gated: its tokens are free until the rule says reasoning
has ended (the end tag itself is free too), and the grammar applies from the next token. Where
the rule requires the start tag (Qwen3), the first token may be either the start tag or one the
grammar allows; any other first token means there is no reasoning, and it goes to the grammar.

The same bitmask carries a request's token mask (core/token_mask.py: allowed_token_ids and
bad_words), intersected with its grammar's row, or alone for a request without one.

Speculative drafts: the scheduler keeps the prefix of a request's drafts that its grammar accepts
(`valid_prefix`: accept, then roll back), and the bitmask has one row per verified position, each
filled after accepting the drafts before it (then rolled back: matchers advance only on the
tokens the request really emits). A gated request gets no drafts until its grammar applies.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from octavo.core.contract import GrammarBitmask, SchedulerOutput
from octavo.core.request import Request
from octavo.core.token_mask import TokenMask
from octavo.params import ReasoningEndRule, StructuredOutputsParams

logger = logging.getLogger(__name__)


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool: ...

    def fill_next_token_bitmask(self, bitmask: np.ndarray, index: int) -> object:
        """Write the allowed next tokens into row `index` of an int32 [rows, words] array."""

    def is_terminated(self) -> bool:
        """The grammar has ended (a stop token was accepted): nothing more may follow."""

    def rollback(self, num_tokens: int) -> object:
        """Undo the last `num_tokens` accepted tokens (speculative drafts are tried, then
        undone)."""


class GrammarBackend(Protocol):
    vocab_size: int

    def compile(self, spec: StructuredOutputsParams) -> object:
        """Compile a grammar for this tokenizer (slow: runs in a worker thread). Raises
        ValueError naming the problem."""

    def matcher(self, compiled: object) -> GrammarMatcher: ...

    def memory_bytes(self, compiled: object) -> int: ...


BackendFactory = Callable[[], GrammarBackend]

_FIRST, _REASONING = range(2)


class _ReasoningGate:
    """A gated request's place before its grammar applies: at its first token, or reasoning."""

    __slots__ = ("rule", "state")

    def __init__(self, rule: ReasoningEndRule) -> None:
        self.rule = rule
        self.state = _FIRST

    def to_grammar(self, token: int) -> bool | None:
        """Take a sampled token: True: it is the grammar's (reasoning is over, or never began);
        False: it is reasoning and the grammar applies from the next token; None: still
        reasoning."""
        rule = self.rule
        if self.state == _FIRST:
            if rule.start_required and token != rule.start_id:
                return True
            self.state = _REASONING
            if token == rule.start_id:
                return None
        return False if token == rule.end_id else None


class StructuredOutputManager:
    def __init__(self, backend_factory: BackendFactory | None, cache_size: int = 256,
                 cache_bytes: int = 256 << 20, compile_timeout_s: float = 60.0,
                 vocab_size: int | None = None) -> None:
        """backend_factory: builds the backend on the first constrained request (in the compile
        thread: loading a tokenizer's vocabulary takes a while); None refuses such requests.
        The cache keeps the `cache_size` most recent grammars within `cache_bytes` (a large
        schema compiles to a few MB). A request whose grammar has not compiled
        `compile_timeout_s` after it was submitted fails alone; the others go on. vocab_size:
        the logits' width, the bitmask's (None: token masks are refused)."""
        self._vocab_size = vocab_size
        self._masks: dict[str, TokenMask] = {}  # allowed_token_ids / bad_words, by request
        self._factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._pool: cf.ThreadPoolExecutor | None = None
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._compiled: OrderedDict[tuple, cf.Future] = OrderedDict()
        self._compiling: dict[str, tuple[tuple, cf.Future]] = {}  # request id -> (key, compile)
        self._compile_timeout_s = compile_timeout_s
        self._submitted: dict[tuple, float] = {}  # key -> when its compile was submitted
        self._matchers: dict[str, GrammarMatcher] = {}
        self._gates: dict[str, _ReasoningGate] = {}  # requests whose grammar waits on reasoning

    # -- requests in and out ---------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        allowed = req.sampling_params.allowed_token_ids
        if allowed or req.bad_words_token_ids:
            if self._vocab_size is None:
                raise ValueError("allowed_token_ids and bad_words: this engine core was not "
                                 "given its vocabulary size")
            self._masks[req.req_id] = TokenMask(allowed, req.bad_words_token_ids,
                                                (self._vocab_size + 31) // 32)
        spec = req.sampling_params.structured_outputs
        if spec is None:
            return
        if self._factory is None:
            raise ValueError("structured_outputs: this engine has no grammar backend")
        key = spec.key()
        fut = self._compiled.get(key)
        if fut is None:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(1, thread_name_prefix="octavo-grammar")
            fut = self._pool.submit(self._compile, spec)
            self._compiled[key] = fut
            self._submitted[key] = time.monotonic()
            self._evict()
        else:
            self._compiled.move_to_end(key)
        self._compiling[req.req_id] = (key, fut)
        if spec.reasoning_end is not None:
            self._gates[req.req_id] = _ReasoningGate(spec.reasoning_end)

    def remove(self, req_id: str) -> None:
        self._masks.pop(req_id, None)
        self._compiling.pop(req_id, None)
        self._matchers.pop(req_id, None)
        self._gates.pop(req_id, None)

    def _evict(self) -> None:
        """Drop the least recently used grammars beyond the cache's bounds (a request that
        still needs one keeps its own reference)."""
        sizes = [self._size(fut) for fut in self._compiled.values()]
        total, i = sum(sizes), 0
        while len(self._compiled) > 1 and (len(self._compiled) > self._cache_size
                                           or total > self._cache_bytes):
            self._compiled.popitem(last=False)
            total -= sizes[i]
            i += 1

    def _size(self, fut: cf.Future) -> int:
        if not fut.done() or fut.cancelled() or fut.exception() is not None:
            return 0
        return self._backend.memory_bytes(fut.result())

    def _compile(self, spec: StructuredOutputsParams) -> object:
        with self._backend_lock:
            if self._backend is None:
                backend = self._factory()
                if self._vocab_size is not None and backend.vocab_size != self._vocab_size:
                    raise ValueError(f"the grammar backend's vocabulary ({backend.vocab_size} "
                                     f"tokens) is not the model's ({self._vocab_size})")
                self._backend = backend
        return self._backend.compile(spec)

    # -- compiles --------------------------------------------------------------------------------

    def is_compiling(self, req_id: str) -> bool:
        return req_id in self._compiling

    def has_compiling(self) -> bool:
        return bool(self._compiling)

    def collect_compiled(self) -> list[tuple[str, str]]:
        """Give each request whose compile finished its matcher. Returns (request id, error) of
        those whose grammar failed to compile (their failed entry leaves the cache)."""
        failed = []
        now = time.monotonic()
        for req_id, (key, fut) in list(self._compiling.items()):
            if not fut.done():
                waited = now - self._submitted.get(key, now)
                if waited > self._compile_timeout_s:
                    del self._compiling[req_id]
                    if self._compiled.get(key) is fut:  # a later request compiles it anew
                        del self._compiled[key]
                    failed.append((req_id, f"the grammar did not compile within "
                                           f"{self._compile_timeout_s:g} s"))
                continue
            del self._compiling[req_id]
            self._submitted.pop(key, None)
            try:
                self._matchers[req_id] = self._backend.matcher(fut.result())
            except Exception as exc:  # reported on the request; the loop goes on
                if self._compiled.get(key) is fut:
                    del self._compiled[key]
                failed.append((req_id, f"{type(exc).__name__}: {exc}" if not
                               isinstance(exc, ValueError) else str(exc)))
        return failed

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until some compile finishes or `timeout` seconds pass (instead of spinning
        while every unfinished request waits on its grammar)."""
        futures = {fut for _, fut in self._compiling.values()}
        if futures:
            cf.wait(futures, timeout, return_when=cf.FIRST_COMPLETED)

    # -- steps -----------------------------------------------------------------------------------

    def valid_prefix(self, req_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of `drafts` the request's grammar accepts after its tokens so far
        (nothing after a token that ends the grammar; none while a reasoning gate is open)."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return drafts
        if req_id in self._gates:
            return []
        n = 0
        for tok in drafts:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return drafts[:n]

    def bitmask_for(self, sched: SchedulerOutput, requests: dict[str, Request]
                    ) -> GrammarBitmask | None:
        """The bitmask of the constrained requests that sample this step (those whose scheduled
        tokens reach their end; a prefill chunk short of it samples nothing): their grammar's
        rows (none for a gated request while it reasons) intersected with their token mask;
        one row per verified position of a request with drafts."""
        if not self._matchers and not self._masks:
            return None
        ids = [rid for rid in sched.num_scheduled_tokens
               if (rid in self._masks or self._grammar_applies(rid))
               and requests[rid].num_computed_tokens >= requests[rid].num_tokens]
        if not ids:
            return None
        vocab = self._vocab_size if self._vocab_size is not None else self._backend.vocab_size
        words = (vocab + 31) // 32
        spec = sched.spec_token_ids
        row_ids = [rid for rid in ids for _ in range(1 + len(spec.get(rid, ())))]
        bitmask = np.zeros((len(row_ids), words), np.int32)
        i = 0
        for rid in ids:
            drafts = spec.get(rid, ())
            if self._grammar_applies(rid):
                self._fill_grammar_rows(rid, bitmask, i, drafts)
            else:
                bitmask[i:i + 1 + len(drafts)] = -1
            mask = self._masks.get(rid)
            if mask is not None:
                output = requests[rid].output_token_ids
                for j in range(1 + len(drafts)):
                    mask.apply(bitmask[i + j], output, drafts[:j])
            i += 1 + len(drafts)
        return GrammarBitmask(row_ids, bitmask)

    def _grammar_applies(self, rid: str) -> bool:
        """The request has a grammar that constrains its next token (not while it reasons; a
        start-required gate at its first token allows the grammar's tokens and the tag)."""
        if rid not in self._matchers:
            return False
        gate = self._gates.get(rid)
        return gate is None or (gate.state == _FIRST and gate.rule.start_required)

    def _fill_grammar_rows(self, rid: str, bitmask: np.ndarray, i: int,
                           drafts: Sequence[int]) -> None:
        matcher = self._matchers[rid]
        words = bitmask.shape[1]
        matcher.fill_next_token_bitmask(bitmask, i)
        gate = self._gates.get(rid)
        start = -1 if gate is None else gate.rule.start_id
        if 0 <= start < words * 32:  # the first token may also open the reasoning section
            bitmask[i].view(np.uint32)[start >> 5] |= np.uint32(1 << (start & 31))
        for tok in drafts:  # valid_prefix checked them: each is accepted
            i += 1
            matcher.accept_token(tok)
            if matcher.is_terminated():  # the request ends at this draft: the row after it
                bitmask[i] = -1  # is never used, but must allow something
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
        if drafts:
            matcher.rollback(len(drafts))

    def refusal(self, req: Request, token: int) -> str | None:
        """Why the token just appended to `req`'s output breaks its token mask (None: it has
        none, or the token is allowed)."""
        mask = self._masks.get(req.req_id)
        if mask is None:
            return None
        out = req.output_token_ids  # the tail before the token is all a bad word can match
        return mask.refusal(token, out[max(0, len(out) - 1 - mask.longest):len(out) - 1])

    def accept(self, req_id: str, token: int) -> bool | None:
        """Advance a request's matcher by a sampled token: None when it has no grammar, else
        whether the grammar took the token."""
        matcher = self._matchers.get(req_id)
        if matcher is None:
            return None
        gate = self._gates.get(req_id)
        if gate is not None:
            to_grammar = gate.to_grammar(token)
            if to_grammar is not None:
                del self._gates[req_id]  # the grammar applies from here on
            if not to_grammar:
                return True  # a reasoning token: free
        if matcher.accept_token(token):
            return True
        logger.error("request %s: sampled token %d is outside its grammar", req_id, token)
        return False

    def is_terminated(self, req_id: str) -> bool:
        matcher = self._matchers.get(req_id)
        return matcher is not None and matcher.is_terminated()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
