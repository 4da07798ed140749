"""POST /v1/embeddings (OpenAI's shape: `input` a string, a list of strings, a list of token ids
or a list of them; `encoding_format` float or base64; `dimensions`; usage), with vLLM's extras
(`truncate_prompt_tokens`, `normalize`, `priority`, `request_id`). The server's engine must run
task embed (an encoder such as all-MiniLM runs it by default)."""
from __future__ import annotations

import base64
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from octavo.entrypoints.http import check_model, state_of
from octavo.entrypoints.openai.pooled import pooling_params, run_pooling
from octavo.entrypoints.openai.shared import engine_id, response_id

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
    params = pooling_params(dimensions=body.dimensions, normalize=body.normalize,
                            truncate_prompt_tokens=body.truncate_prompt_tokens)
    rid = response_id("embd", body)
    outs, tokens = await run_pooling(state, request, engine_id(rid, body), inputs, params,
                                     priority=body.priority)
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
