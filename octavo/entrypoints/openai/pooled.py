"""What the pooling endpoints share (embeddings.py, scores.py): their PoolingParams, with a bad
field a 400 naming it, and running a batch of pooling requests to their outputs."""
from __future__ import annotations

import asyncio

from fastapi import Request

from octavo.entrypoints.http import APIError, ServerState, unless_disconnected
from octavo.pooling_params import PoolingParams, PoolingRequestOutput


def pooling_params(**fields) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except ValueError as exc:  # its message starts with the field's name
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None


async def run_pooling(state: ServerState, request: Request, base: str, prompts: list,
                      params: PoolingParams, pairs: list[str] | None = None,
                      field: str = "input") -> tuple[list[PoolingRequestOutput], int]:
    """Each prompt (with its pair's second text) pooled: the outputs in order and the prompt
    tokens they took. A prompt that is refused is a 400 naming `field` and its index."""
    engine = state.engine
    if not prompts:
        raise APIError(400, f"{field} must not be empty", field)
    engine.check_size(len(prompts), 1)
    prepared = []
    for i, prompt in enumerate(prompts):
        try:
            prepared.append(await engine.prepare_pooling_async(
                f"{base}-{i}", prompt, params, None if pairs is None else pairs[i]))
        except ValueError as exc:
            raise APIError(400, f"{field}[{i}]: {exc}" if len(prompts) > 1 else str(exc),
                           field) from None
    streams = engine.generate_all(prepared)

    async def last(stream):
        out = None
        async for out in stream:
            pass
        return out

    async def run_all():
        return await asyncio.gather(*(last(s) for s in streams))

    outs = await unless_disconnected(request, run_all())
    return outs, sum(len(p.prompt_token_ids) for p in prepared)
