"""vLLM's scoring endpoints on a cross-encoder (a *ForSequenceClassification model of one label):
POST /score (and /v1/score: `text_1` against `text_2`, one against many or pair by pair),
/rerank, /v1/rerank and /v2/rerank (Jina's and Cohere's shape: a `query`, `documents`, `top_n`,
`return_documents`), and /classify (/v1/classify: a classifier's probabilities and its label)."""
from __future__ import annotations

import time

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict

from octavo.entrypoints.http import APIError, check_model, state_of
from octavo.entrypoints.openai.pooled import pooling_params, run_pooling
from octavo.entrypoints.openai.shared import engine_id, response_id

router = APIRouter()


class _Scoring(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    truncate_prompt_tokens: int | None = None
    request_id: str | None = None
    user: str | None = None


class ScoreRequest(_Scoring):
    text_1: str | list[str]
    text_2: str | list[str]


class RerankRequest(_Scoring):
    query: str
    documents: list[str]
    top_n: int | None = None
    return_documents: bool = True


class ClassifyRequest(_Scoring):
    input: str | list[str]


async def _scores(request: Request, body: _Scoring, first: list[str], second: list[str],
                  prefix: str) -> tuple[str, str, list[float], int]:
    """(response id, model, each pair's score, prompt tokens)."""
    state = state_of(request)
    model = check_model(state, body.model)
    params = pooling_params(task="score", truncate_prompt_tokens=body.truncate_prompt_tokens)
    rid = response_id(prefix, body)
    outs, tokens = await run_pooling(state, request, engine_id(rid, body), first, params,
                                     second, "text_1" if prefix == "score" else "documents")
    return rid, model, [float(o.outputs.data[0]) for o in outs], tokens


@router.post("/score")
@router.post("/v1/score")
async def score(body: ScoreRequest, request: Request):
    first = [body.text_1] if isinstance(body.text_1, str) else list(body.text_1)
    second = [body.text_2] if isinstance(body.text_2, str) else list(body.text_2)
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise APIError(400, f"text_1 has {len(first)} texts for the {len(second)} of text_2: "
                       f"give one, or as many", "text_1")
    rid, model, scores, tokens = await _scores(request, body, first, second, "score")
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, request: Request):
    if body.top_n is not None and body.top_n < 1:
        raise APIError(400, f"top_n must be >= 1, got {body.top_n}", "top_n")
    rid, model, scores, tokens = await _scores(
        request, body, [body.query] * len(body.documents), body.documents, "rerank")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
               for i in order]
    return {"id": rid, "model": model, "usage": {"total_tokens": tokens}, "results": results}


@router.post("/classify")
@router.post("/v1/classify")
async def classify(body: ClassifyRequest, request: Request):
    state = state_of(request)
    model = check_model(state, body.model)
    inputs = [body.input] if isinstance(body.input, str) else list(body.input)
    params = pooling_params(task="classify", truncate_prompt_tokens=body.truncate_prompt_tokens)
    rid = response_id("classify", body)
    outs, tokens = await run_pooling(state, request, engine_id(rid, body), inputs, params)
    names = state.engine.setup.arch.extra.get("id2label") or {}
    data = []
    for i, out in enumerate(outs):
        probs = out.outputs.data.tolist()
        best = max(range(len(probs)), key=probs.__getitem__)
        data.append({"index": i, "label": names.get(str(best), f"LABEL_{best}"),
                     "probs": probs, "num_classes": len(probs)})
    return {"id": rid, "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
