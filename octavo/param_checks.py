"""The checks behind SamplingParams' validation: numbers within their bounds, and vLLM's
token-level fields (allowed_token_ids, bad_words, detokenize, truncate_prompt_tokens,
spaces_between_special_tokens, logprob_token_ids, extra_args). Each raises a ValueError that
names the field. What needs the model (the vocabulary, the context length, the tokenizer) is
checked by the engine's processor."""
from __future__ import annotations

import math
from typing import Any

INT64_MAX = 2**63 - 1  # every integer crosses to the core as msgpack's int64
INT64_MIN = -(2**63)
MAX_LOGPROB_TOKEN_IDS = 128  # vLLM's bound on logprob_token_ids
_MAX_EXTRA_ARGS_DEPTH = 32


def check_int(name: str, value: object, low: int, high: int = INT64_MAX) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r:.80}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value!r:.80}")
    if value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r:.80}")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer past float's range
        return False


def check_float(name: str, value: object, low: float | None, high: float | None) -> None:
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not _finite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r:.80}")
    if low is not None and value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r:.80}")


def check_logprobs(name: str, value: int | None) -> None:
    """None, a count >= 0, or -1: the whole vocabulary (bounded by the engine's max_logprobs)."""
    if value is not None:
        check_int(name, value, -1)


def token_id_list(name: str, value: object, max_len: int | None = None) -> list[int] | None:
    """A non-empty list of token ids (>= 0; the vocabulary bound is the processor's)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of token ids, got {value!r:.80}")
    ids = list(value)
    if not ids:
        raise ValueError(f"{name} must not be empty (leave it unset for no restriction)")
    if max_len is not None and len(ids) > max_len:
        raise ValueError(f"{name} holds {len(ids)} ids; at most {max_len} are allowed")
    for tok in ids:
        check_int(name, tok, 0)
    return ids


def check_bad_words(value: object) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        raise ValueError(f"bad_words must be a list of strings, got {value!r:.80}")
    for word in value:
        if not isinstance(word, str) or not word.strip():
            raise ValueError(f"bad_words must hold non-empty strings, got {word!r:.80}")
    return list(dict.fromkeys(value))  # vLLM drops repeats


def check_truncate_prompt_tokens(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1) \
            or value > INT64_MAX:
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1 (the context "
                         f"length), got {value!r:.80}")


def check_extra_args(value: object) -> None:
    """A dict of JSON values (str keys; int64 integers, finite floats): it crosses to the core
    as msgpack and reaches custom sampling code untouched."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise ValueError(f"extra_args must be a dict, got {type(value).__name__}")
    _check_json("extra_args", value, 0)


def _check_json(path: str, value: Any, depth: int) -> None:
    if depth > _MAX_EXTRA_ARGS_DEPTH:
        raise ValueError(f"extra_args nests deeper than {_MAX_EXTRA_ARGS_DEPTH} levels")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise ValueError(f"{path} must be JSON-serializable within int64, got {value}")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be JSON-serializable: {value} is not finite")
    elif isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ValueError(f"{path} must be JSON-serializable: key {key!r:.40} is not a "
                                 f"string")
            _check_json(f"{path}[{key!r:.40}]", item, depth + 1)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_json(f"{path}[{i}]", item, depth + 1)
    else:
        raise ValueError(f"{path} must be JSON-serializable, got a {type(value).__name__}")


def check_token_fields(p: Any) -> None:
    """SamplingParams' vLLM token-level fields (normalizing lists in place)."""
    p.allowed_token_ids = token_id_list("allowed_token_ids", p.allowed_token_ids)
    if p.allowed_token_ids is not None:
        p.allowed_token_ids = list(dict.fromkeys(p.allowed_token_ids))
    p.bad_words = check_bad_words(p.bad_words)
    for name in ("detokenize", "spaces_between_special_tokens"):
        check_bool(name, getattr(p, name))
    if not p.detokenize and p.stop_strings:
        raise ValueError("stop strings are only supported when detokenize is True; set "
                         "detokenize=True to use stop")
    check_truncate_prompt_tokens(p.truncate_prompt_tokens)
    p.logprob_token_ids = token_id_list("logprob_token_ids", p.logprob_token_ids,
                                        MAX_LOGPROB_TOKEN_IDS)
    if p.logprob_token_ids is not None:
        if p.logprobs is None:  # vLLM's num_logprobs: one per listed token
            p.logprobs = len(p.logprob_token_ids)
        elif p.logprobs != len(p.logprob_token_ids):
            raise ValueError(f"logprobs must equal len(logprob_token_ids) "
                             f"({len(p.logprob_token_ids)}) when both are set, got {p.logprobs}")
    check_extra_args(p.extra_args)
