"""What the pooling endpoints share (embeddings.py, scores.py, and gRPC's Embed): their
PoolingParams, with a bad field a 400 naming it, and running a batch of pooling requests to
their outputs."""
from __future__ import annotations

import asyncio

from fastapi import Request

from octavo.entrypoints.http import APIError, ServerState, bounded, until_disconnected
from octavo.pooling_params import PoolingParams, PoolingRequestOutput


def pooling_params(**fields) -> PoolingParams:
    try:
        return PoolingParams(**fields)
    except ValueError as exc:  # its message starts with the field's name
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None


async def run_pooling(state: ServerState, request: Request | None, base: str, prompts: list,
                      params: PoolingParams, pairs: list[str] | None = None,
                      field: str = "input", priority: int = 0
                      ) -> tuple[list[PoolingRequestOutput], int]:
    """Each prompt (with its pair's second text) pooled: the outputs in order and the prompt
    tokens they took. A prompt that is refused is a 400 naming `field` and its index; an
    HTTP `request` whose client leaves cancels them (None: the caller's task is cancelled
    instead), as does the request timeout; one aborted is a 499."""
    engine = state.engine
    if not prompts:
        raise APIError(400, f"{field} must not be empty", field)
    engine.check_size(len(prompts), 1)
    prepared = []
    for i, prompt in enumerate(prompts):
        try:
            prepared.append(await engine.prepare_pooling_async(
                f"{base}-{i}", prompt, params, None if pairs is None else pairs[i], priority))
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

    outs = await bounded(state, run_all(), None,
                         None if request is None else until_disconnected(request))
    if any(out.outputs.data.size == 0 for out in outs):  # finished by an abort
        raise APIError(499, "the request was aborted")
    return outs, sum(len(p.prompt_token_ids) for p in prepared)
