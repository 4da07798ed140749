"""Validate and tokenize inputs; turn them into the core's protocol requests (EngineCoreRequest)."""
from __future__ import annotations

import numbers
import time
from collections.abc import Sequence
from dataclasses import dataclass

from octavo.core.protocol import EngineCoreRequest
from octavo.engine.grammar import check_structured
from octavo.engine.pooling import Embeddings
from octavo.inputs import unwrap_prompt
from octavo.lora.registry import AdapterRegistry
from octavo.params import LoRARequest, SamplingParams
from octavo.pooling_params import PoolingParams

MAX_LOGPROBS = 20
MAX_BAD_WORDS = 128  # token sequences after tokenizing, as vLLM bounds them
MAX_BAD_WORDS_TOKENS = 1024  # tokens of all of them: the core checks each per sampled token
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class RequestLimits:
    """What one request may ask for, checked before anything of it is registered. The server
    sets them from --max-n, --max-stop, --max-stop-length and --max-logprobs; offline, only
    max_logprobs bounds (the caller's own process pays for what it asks)."""

    max_n: int | None = None  # n, best_of and the beam width
    max_stop: int | None = None  # stop strings in one request
    max_stop_length: int | None = None  # characters of one stop string
    max_logprobs: int = MAX_LOGPROBS  # -1: the whole vocabulary

    def __post_init__(self) -> None:
        for name, low in (("max_n", 1), ("max_stop", 1), ("max_stop_length", 1),
                          ("max_logprobs", -1)):
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
                 eos_token_ids: frozenset[int], limits: RequestLimits | None = None,
                 adapters: AdapterRegistry | None = None,
                 embeddings: Embeddings | None = None, generates: bool = True) -> None:
        """embeddings: what pooling requests give (None: they are refused); generates: False
        for an engine of task embed, which refuses generation."""
        self.tokenizer = tokenizer
        self.embeddings = embeddings
        self.generates = generates
        self.adapters = adapters
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.limits = limits or RequestLimits()

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True
                 ) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens)
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
        self._check_logprobs(params, max_logprobs)
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
        for name in ("allowed_token_ids", "logprob_token_ids"):
            for tok in getattr(params, name) or ():
                if tok >= self.vocab_size:
                    raise ValueError(f"{name} holds token id {tok}, outside the vocabulary "
                                     f"[0, {self.vocab_size})")
        if params.min_tokens > max_tokens:
            raise ValueError(f"min_tokens ({params.min_tokens}) exceeds max_tokens ({max_tokens})")
        if params.structured_outputs is not None:  # a bad grammar is refused here, not in the core
            check_structured(params.structured_outputs)
        return max_tokens

    def _check_logprobs(self, params: SamplingParams, max_logprobs: int | None) -> None:
        """logprobs and prompt_logprobs within the limit (vLLM's rule: -1 is the whole
        vocabulary, so it needs a limit of at least the vocabulary size; a limit of -1 allows
        it). logprob_token_ids lists its tokens itself, bounded by its own length limit."""
        limit = self.limits.max_logprobs if max_logprobs is None else max_logprobs
        limit = self.vocab_size if limit == -1 else min(limit, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is None or (name == "logprobs" and params.logprob_token_ids is not None):
                continue
            if k == -1 and self.vocab_size > limit:
                raise ValueError(f"{name}=-1 asks for the whole vocabulary ({self.vocab_size} "
                                 f"tokens); at most {limit} are allowed (max_logprobs, the "
                                 f"server's --max-logprobs)")
            if k > limit:
                raise ValueError(f"{name} must be <= {limit}, got {k}")

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """Each bad word's token sequences as vLLM builds them: the word as written (its
        leading space dropped), and with one leading space where that is a different token
        sequence of the same length (the word inside a text)."""
        seqs: list[list[int]] = []
        for word in params.bad_words or ():
            for spaced in (False, True):
                ids = self.tokenizer.encode((" " if spaced else "") + word.lstrip(), False)
                if not ids:
                    if not spaced:
                        raise ValueError(f"bad_words entry {word!r:.40} has no tokens")
                    continue
                if not spaced or (ids[0] != seqs[-1][0] and len(ids) == len(seqs[-1])):
                    seqs.append(ids)
        seqs = [list(t) for t in dict.fromkeys(map(tuple, seqs))]  # "a" and " a" give the same
        if len(seqs) > MAX_BAD_WORDS:
            raise ValueError(f"bad_words make {len(seqs)} token sequences; at most "
                             f"{MAX_BAD_WORDS} are allowed")
        if sum(map(len, seqs)) > MAX_BAD_WORDS_TOKENS:
            raise ValueError(f"bad_words are {sum(map(len, seqs))} tokens in all; at most "
                             f"{MAX_BAD_WORDS_TOKENS} are allowed")
        for tok in (t for seq in seqs for t in seq):
            if not 0 <= tok < self.vocab_size:
                raise ValueError(f"bad_words tokenize to token id {tok}, outside the "
                                 f"vocabulary [0, {self.vocab_size})")
        if params.allowed_token_ids and \
                set(params.allowed_token_ids) <= {seq[0] for seq in seqs if len(seq) == 1}:
            raise ValueError("bad_words ban every one of allowed_token_ids: nothing could be "
                             "sampled")
        return seqs

    def truncate(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        """truncate_prompt_tokens: the prompt's last k tokens (-1: the context length)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        if k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                             f"({self.max_model_len}); choose a smaller truncation size")
        k = self.max_model_len if k == -1 else k
        return prompt_ids[-k:]

    def child_params(self, params: SamplingParams, index: int) -> SamplingParams:
        """Parameters of the index-th of the n (or best_of) parallel samples (distinct seeds when
        seeded; best_of > n needs each sample's cumulative logprob, so logprobs is at least 0);
        a logprobs of -1 becomes the vocabulary size, which the worker gathers."""
        whole = [name for name in ("logprobs", "prompt_logprobs") if getattr(params, name) == -1]
        if params.num_samples == 1 and not whole:
            return params
        fields = {k: getattr(params, k) for k in params.__dataclass_fields__ if k != "stop_strings"}
        for name in whole:
            fields[name] = self.vocab_size
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
              max_logprobs: int | None = None,
              add_special_tokens: bool = True,
              lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Validate and tokenize (a text prompt with the tokenizer's special tokens, e.g. BOS,
        unless `add_special_tokens` is False); keep the last truncate_prompt_tokens of the
        prompt; fan n > 1 (or best_of > 1) out into that many core requests with distinct
        seeds. `prompt` may be any of octavo.inputs' forms (a TextPrompt or TokensPrompt may
        carry the cache_salt). `max_logprobs` is raised only by beam search (2 x beam
        width)."""
        if not self.generates:
            task = self.embeddings.task if self.embeddings is not None else "embed"
            raise ValueError(f"this engine runs task {task}: it pools prompts (LLM.embed, "
                             f"/v1/embeddings and the like) and does not generate; start it "
                             f"with task generate for text")
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
        if not isinstance(add_special_tokens, bool):
            raise ValueError(f"add_special_tokens must be a bool, got {add_special_tokens!r:.80}")
        if lora_request is not None:
            if self.adapters is None:
                raise ValueError("lora_request: this engine runs without LoRA")
            self.adapters.check(lora_request)
        text, prompt_ids = self.tokenize(prompt, add_special_tokens)
        if isinstance(params, SamplingParams):
            prompt_ids = self.truncate(prompt_ids, params)
        max_tokens = self.validate(prompt_ids, params, max_logprobs)
        bad_words = self.bad_words_token_ids(params)
        count = params.num_samples
        ids = [request_id] if count == 1 else [f"{request_id}#{i}" for i in range(count)]
        now = time.time()
        reqs = [EngineCoreRequest(cid, prompt_ids, self.child_params(params, i),
                                  self.eos_token_ids, max_tokens, arrival_time=now,
                                  priority=priority, cache_salt=cache_salt,
                                  bad_words_token_ids=bad_words, lora_request=lora_request)
                for i, cid in enumerate(ids)]
        return PreparedRequest(request_id, text, prompt_ids, params, reqs)


    def build_pooling(self, request_id: str, prompt: str | Sequence[int],
                      params: PoolingParams, priority: int = 0,
                      pair: str | None = None) -> PreparedRequest:
        """Validate and tokenize a pooling request: its prompt (a text's special tokens kept
        when truncate_prompt_tokens cuts it, from the end), with `pair` the second text of a
        sentence pair (task score), fits the context and one step."""
        emb = self.embeddings
        if emb is None:
            raise ValueError("this engine does not pool prompts into embeddings")
        params = emb.resolve(params, pair)
        prompt, _ = unwrap_prompt(prompt)
        k = params.truncate_prompt_tokens
        if k is not None and k > self.max_model_len:
            raise ValueError(f"truncate_prompt_tokens ({k}) is greater than max_model_len "
                             f"({self.max_model_len})")
        k = self.max_model_len if k == -1 else k
        if pair is not None:
            if not isinstance(prompt, str) or not prompt or not isinstance(pair, str) \
                    or not pair:
                raise ValueError("a pair's texts must be non-empty strings")
            text, prompt_ids = prompt, self.tokenizer.encode(prompt, max_tokens=k, pair=pair)
        elif isinstance(prompt, str) and k is not None:
            if not prompt:
                raise ValueError("prompt must not be empty")
            text, prompt_ids = prompt, self.tokenizer.encode(prompt, max_tokens=k)
        else:
            text, prompt_ids = self.tokenize(prompt)
            prompt_ids = prompt_ids[:k] if k is not None else prompt_ids
        n = len(prompt_ids)
        if n > self.max_model_len:
            raise ValueError(f"prompt is {n} tokens, max_model_len is {self.max_model_len}: "
                             f"set truncate_prompt_tokens to cut it")
        positions = emb.positions(params)
        if positions == "whole" and n > emb.step_tokens:
            raise ValueError(f"prompt is {n} tokens; an encoder computes a prompt in one step "
                             f"of at most max_num_batched_tokens ({emb.step_tokens})")
        req = EngineCoreRequest(request_id, prompt_ids, _POOLING_SAMPLING, self.eos_token_ids, 1,
                                arrival_time=time.time(), priority=priority,
                                pooling_params=params, pooled_positions=positions)
        return PreparedRequest(request_id, text, prompt_ids, _POOLING_SAMPLING, [req])


# What a pooling request carries in place of sampling: one step, nothing sampled or detokenized.
_POOLING_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)


@dataclass
class PreparedRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    core_requests: list[EngineCoreRequest]

    @property
    def child_ids(self) -> list[str]:
        return [r.req_id for r in self.core_requests]

    @property
    def pooling(self) -> bool:
        """A pooling request: its output is its vector (PoolingRequestOutput)."""
        return self.core_requests[0].pooling_params is not None
