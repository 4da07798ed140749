"""POST /v1/embeddings (OpenAI's shape: `input` a string, a list of strings, a list of token ids
or a list of them; `encoding_format` float or base64; `dimensions`; usage), with vLLM's extras
(`truncate_prompt_tokens`, `normalize`, `priority`, `request_id`); and vLLM's POST /pooling,
the same body with a `task` (token_embed: a vector per token; reward: per-token or per-step
values) whose outputs are nested lists. Any model pools (an encoder, or a causal LM's last
token)."""
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


class PoolingRequest(EmbeddingRequest):
    task: Literal["embed", "token_embed", "classify", "reward"] | None = None  # the engine's
    step_tag_id: int | None = None  # task reward
    returned_token_ids: list[int] | None = None  # task reward on an LM head


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request):
    return await _pooled(body, request, "embd", "embedding", "embed")


@router.post("/pooling")
async def pooling(body: PoolingRequest, request: Request):
    return await _pooled(body, request, "pool", "pooling", body.task, body.step_tag_id,
                         body.returned_token_ids)


async def _pooled(body: EmbeddingRequest, request: Request, prefix: str, kind: str,
                  task: str | None, step_tag_id: int | None = None,
                  returned_token_ids: list[int] | None = None) -> dict:
    state = state_of(request)
    model = check_model(state, body.model)
    inputs = body.input
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    params = pooling_params(task=task, dimensions=body.dimensions, normalize=body.normalize,
                            truncate_prompt_tokens=body.truncate_prompt_tokens,
                            step_tag_id=step_tag_id, returned_token_ids=returned_token_ids)
    rid = response_id(prefix, body)
    outs, tokens = await run_pooling(state, request, engine_id(rid, body), inputs, params,
                                     priority=body.priority)
    field = "embedding" if kind == "embedding" else "data"
    data = [{"object": kind, "index": i, field: _encoded(out.outputs.data, body.encoding_format)}
            for i, out in enumerate(outs)]
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encoded(vector: np.ndarray, encoding_format: str) -> list | str:
    """float: a list of numbers (of lists, for one vector per position); base64: the float32
    little-endian bytes, as OpenAI sends them (several vectors one after another)."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, "<f4").tobytes()).decode()
    return vector.tolist()
