"""Validate and tokenize inputs; turn them into core requests."""
from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass

from octavo.core.request import Request
from octavo.engine.grammar import check_structured
from octavo.inputs import unwrap_prompt
from octavo.params import SamplingParams

MAX_LOGPROBS = 20
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, checked before anything of it is registered. The server
    sets them from --max-n, --max-stop, --max-stop-length and --max-logprobs; offline, only
    max_logprobs bounds (the caller's own process pays for what it asks)."""

    max_n: int | None = None  # n, best_of and the beam width
    max_stop: int | None = None  # stop strings in one request
    max_stop_length: int | None = None  # characters of one stop string
    max_logprobs: int = MAX_LOGPROBS

    def __post_init__(self) -> None:
        for name, low in (("max_n", 1), ("max_stop", 1), ("max_stop_length", 1),
                          ("max_logprobs", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")

    def check_width(self, name: str, width: int) -> None:
        """n, best_of or a beam width against max_n."""
        if self.max_n is not None and width > self.max_n:
            raise ValueError(f"{name} must be <= {self.max_n} (the server's --max-n), "
                             f"got {width}")


class Processor:
    def __init__(self, tokenizer, max_model_len: int, vocab_size: int,
                 eos_token_ids: frozenset[int], limits: RequestLimits | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits or RequestLimits()

    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)) or not prompt:
            raise ValueError("prompt must be a non-empty string or list of token ids")
        for t in prompt:  # numpy integers are ids too; bools and floats are not
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) \
                    or not 0 <= t < self.vocab_size:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size}), got {t!r}")
        return None, [int(t) for t in prompt]

    def validate(self, prompt_ids: list[int], params: SamplingParams,
                 max_logprobs: int | None = None) -> int:
        """Check `params` against the model and the limits; returns the resolved max_tokens.
        `max_logprobs` overrides the limit (beam search asks for 2 x its width)."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt is {n} tokens, max_model_len is {self.max_model_len}: "
                             "it must leave room for at least one output token")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len ({self.max_model_len})")
        limits = self.limits
        max_logprobs = min(limits.max_logprobs if max_logprobs is None else max_logprobs,
                           self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > max_logprobs:
                raise ValueError(f"{name} must be <= {max_logprobs}, got {k}")
        limits.check_width("n", params.n)
        if params.best_of is not None:
            limits.check_width("best_of", params.best_of)
        if params.top_k > self.vocab_size:
            raise ValueError(f"top_k must be <= the vocabulary size ({self.vocab_size}) or -1 "
                             f"(off), got {params.top_k}")
        stops = params.stop_strings
        if limits.max_stop is not None and len(stops) > limits.max_stop:
            raise ValueError(f"stop holds {len(stops)} strings; at most {limits.max_stop} are "
                             f"allowed (the server's --max-stop)")
        if limits.max_stop_length is not None:
            for s in stops:
                if len(s) > limits.max_stop_length:
                    raise ValueError(f"stop strings must be at most {limits.max_stop_length} "
                                     f"characters (the server's --max-stop-length), got one of "
                                     f"{len(s)}")
        if limits.max_stop is not None and len(params.stop_token_ids) > limits.max_stop:
            raise ValueError(f"stop_token_ids holds {len(params.stop_token_ids)} ids; at most "
                             f"{limits.max_stop} are allowed (the server's --max-stop)")
        for tok in list(params.logit_bias or {}) + params.stop_token_ids:
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"token id {tok} (in logit_bias or stop_token_ids) is outside "
                                 f"the vocabulary [0, {self.vocab_size})")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})")
        if params.structured_outputs is not None:  # a bad grammar is refused here, not in the core
            check_structured(params.structured_outputs)
        return max_tokens

    def child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Parameters of the index-th of the n (or best_of) parallel samples (distinct seeds when
        seeded; best_of > n needs each sample's cumulative logprob, so logprobs is at least 0)."""
        if params.num_samples == 1:
            return params
        fields = {k: getattr(params, k) for k in params.__dataclass_fields__ if k != "stop_strings"}
        fields["n"], fields["best_of"] = 1, None
        if params.num_samples > params.n and params.logprobs is None:
            fields["logprobs"] = 0
        if index > 0:  # the prompt is the same for every sample: score it once
            fields["prompt_logprobs"] = None
        if params.seed is not None:  # wraps within int64, the seed's range
            fields["seed"] = (params.seed + index + 2**63) % 2**64 - 2**63
        return SamplingParams(**fields)

    def build(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
              priority: int = 0, cache_salt: str | None = None,
              max_logprobs: int | None = None) -> PreparedRequest:
        """Validate and tokenize; fan n > 1 (or best_of > 1) out into that many core requests
        with distinct seeds. `prompt` may be any of octavo.inputs' forms (a TextPrompt or
        TokensPrompt may carry the cache_salt). `max_logprobs` is raised only by beam search
        (2 x beam width)."""
        prompt, own_salt = unwrap_prompt(prompt)
        if own_salt is not None:
            if cache_salt is not None and cache_salt != own_salt:
                raise ValueError("cache_salt is given both in the prompt and as an argument")
            cache_salt = own_salt
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r:.80}")
        if not INT32_MIN <= priority <= INT32_MAX:
            raise ValueError(f"priority must be in [{INT32_MIN}, {INT32_MAX}], "
                             f"got {priority!r:.80}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError("cache_salt must be a non-empty string")
        text, prompt_ids = self.tokenize(prompt)
        max_tokens = self.validate(prompt_ids, params, max_logprobs)
        count = params.num_samples
        ids = [request_id] if count == 1 else [f"{request_id}#{i}" for i in range(count)]
        now = time.time()
        reqs = [Request(cid, prompt_ids, self.child_params(params, i), self.eos_token_ids,
                        max_tokens, priority=priority, arrival_time=now, cache_salt=cache_salt)
                for i, cid in enumerate(ids)]
        return PreparedRequest(request_id, text, prompt_ids, params, reqs)


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[Request]

    @property
    def child_ids(self) -> list[str]:
        return [r.req_id for r in self.core_requests]
