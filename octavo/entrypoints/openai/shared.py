"""What /v1/completions and /v1/chat/completions share: the refusal of unsupported fields, the
structured-output check, usage, server-sent events, a stream's deltas merged back, and vLLM's
request extensions common to both (the request_id rule, return_token_ids, usage on every chunk).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from octavo.entrypoints.chat_plan import check_output_spec
from octavo.entrypoints.http import APIError, ServerState, error_body, stream_error
from octavo.entrypoints.openai.protocol import UNSUPPORTED
from octavo.params import CompletionOutput, RequestOutput, StructuredOutputsParams


def refuse_unsupported(req) -> None:
    bad = req.unsupported_fields()
    if bad:
        raise APIError(400, f"'{bad[0]}' is not supported yet ({UNSUPPORTED[bad[0]]})", bad[0])


async def structured(state: ServerState, body) -> StructuredOutputsParams | None:
    """The request's output constraint, its grammar checked: a problem is a 400 naming it."""
    param = "structured_outputs" if body.structured_outputs is not None else "response_format"
    try:
        spec, field = body.structured_params()
    except ValueError as exc:
        raise APIError(400, str(exc), param) from None
    await check_output_spec(state, spec, field, param)
    return spec


def usage(prompt_tokens: int, completion_tokens: int, cached: int = 0) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def stream_error_event(exc: Exception, partial: dict) -> str:
    """The error event that ends a chat or completion stream (http.stream_error)."""
    status, message = stream_error(exc)
    return sse(error_body("/v1", status, message, usage=partial))


class Collected:
    """The deltas of one request merged back into complete outputs."""

    def __init__(self) -> None:
        self.text: dict[int, str] = {}
        self.tokens: dict[int, list[int]] = {}
        self.logprobs: dict[int, list] = {}
        self.last: dict[int, CompletionOutput] = {}
        self.final: RequestOutput | None = None

    def add(self, out: RequestOutput) -> None:
        for c in out.outputs:
            self.text[c.index] = self.text.get(c.index, "") + c.text
            self.tokens.setdefault(c.index, []).extend(c.token_ids)
            if c.logprobs is not None:
                self.logprobs.setdefault(c.index, []).extend(c.logprobs)
            self.last[c.index] = c
        self.final = out

    def usage(self, prompt_tokens: int) -> dict:
        return usage(prompt_tokens, sum(len(t) for t in self.tokens.values()),
                     self.final.num_cached_tokens if self.final else 0)


async def collect(stream: AsyncIterator[RequestOutput],
                  collected: Collected | None = None) -> Collected:
    collected = collected or Collected()
    async for out in stream:
        collected.add(out)
    return collected


# -- vLLM's request extensions ----------------------------------------------------------------

def response_id(prefix: str, body) -> str:
    """The response's id: `<prefix>-<request_id>` (vLLM's), else a random one."""
    return f"{prefix}-{body.request_id if body.request_id is not None else uuid.uuid4().hex}"


def engine_id(rid: str, body) -> str:
    """The engine's id for a response: a client's request_id may be anyone's (two clients can
    pick the same one, or one that looks like another's internal id), so it gets a random
    suffix there; the response keeps the id the client chose."""
    return rid if body.request_id is None else f"{rid}.{uuid.uuid4().hex[:16]}"


def usage_options(body) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats): as in vLLM, usage on every chunk only where
    the final usage chunk is asked for too."""
    opts = body.stream_options
    include = bool(opts and opts.include_usage)
    return include, include and bool(opts.continuous_usage_stats)


def token_ids_fields(body, choice: dict, token_ids: list[int],
                     prompt_token_ids: list[int] | None = None) -> dict:
    """return_token_ids: the choice's token_ids (and, where given, the prompt's)."""
    if body.return_token_ids:
        if prompt_token_ids is not None:
            choice["prompt_token_ids"] = list(prompt_token_ids)
        choice["token_ids"] = list(token_ids)
    return choice
