"""POST /v1/embeddings (OpenAI's shape: `input` a string, a list of strings, a list of token ids
or a list of them; `encoding_format` float or base64; `dimensions`; usage), with vLLM's extras
(`truncate_prompt_tokens`, `normalize`, `priority`, `request_id`). The server's engine must run
task embed (an encoder such as all-MiniLM runs it by default)."""
from __future__ import annotations

import asyncio
import base64
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from octavo.entrypoints.http import APIError, check_model, state_of, unless_disconnected
from octavo.entrypoints.openai.shared import engine_id, response_id
from octavo.pooling_params import PoolingParams

router = APIRouter()


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # octavo / vLLM extras
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    priority: int = 0
    request_id: str | None = None


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    if not inputs:
        raise APIError(400, "input must not be empty", "input")
    engine = state.engine
    engine.check_size(len(inputs), 1)
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize,
                               truncate_prompt_tokens=body.truncate_prompt_tokens)
    except ValueError as exc:
        raise APIError(400, str(exc), str(exc).split(" ", 1)[0]) from None
    rid = response_id("embd", body)
    base = engine_id(rid, body)
    prepared = []
    for i, item in enumerate(inputs):
        try:
            prepared.append(await engine.prepare_pooling_async(f"{base}-{i}", item, params))
        except ValueError as exc:
            raise APIError(400, f"input[{i}]: {exc}" if len(inputs) > 1 else str(exc),
                           "input") from None
    streams = engine.generate_all(prepared)

    async def last(stream):
        out = None
        async for out in stream:
            pass
        return out

    async def run_all():
        return await asyncio.gather(*(last(s) for s in streams))

    outs = await unless_disconnected(request, run_all())
    tokens = sum(len(p.prompt_token_ids) for p in prepared)
    data = [{"object": "embedding", "index": i,
             "embedding": _encoded(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(outs)]
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """float: a list of numbers; base64: the float32 little-endian bytes, as OpenAI sends them."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return vector.tolist()
