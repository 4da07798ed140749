"""`use_beam_search` on /v1/completions and /v1/chat/completions: the request's prompts are
searched together by the front end's beam search (octavo/engine/beam_search.py) and the best `n`
beams of each come back as its choices. Not streamed."""
from __future__ import annotations

import time

from fastapi import Request

from octavo.engine import beam_search as beam
from octavo.entrypoints.http import APIError, ServerState, adapter_of, unless_disconnected
from octavo.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from octavo.entrypoints.openai.shared import engine_id, response_id


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 0}}


async def _searches(state: ServerState, body, rid: str, prompts: list,
                    max_tokens: int | None) -> list[beam.BeamSearch]:
    """Tokenized and checked in the front end's pool, within its budget."""
    engine = state.engine

    def start_all() -> list[beam.BeamSearch]:
        searches = []
        for i, prompt in enumerate(prompts):
            _, ids = engine.processor.tokenize(prompt)
            params = body.beam_params(max_tokens, engine.max_model_len, len(ids))
            searches.append(beam.start(engine, f"{rid}-{i}", prompt, params, body.cache_salt,
                                       adapter_of(state, body.model)))
        return searches

    try:
        return await engine.offload.run("tokenizing the prompts", start_all)
    except ValueError as exc:  # the messages start with the field's name
        raise APIError(400, str(exc), str(exc).split(" ")[0].strip("'")) from None


async def beam_completions(state: ServerState, body: CompletionRequest, request: Request,
                           prompts: list, model: str) -> dict:
    rid = response_id("cmpl", body)
    searches = await _searches(state, body, engine_id(rid, body), prompts, body.max_tokens)
    await unless_disconnected(request, beam.run_async(state.engine, searches, body.priority))
    choices, n_prompt, n_out = [], 0, 0
    for i, search in enumerate(searches):
        n_prompt += len(search.prompt_ids)
        for c in search.output(state.engine.tokenizer, body.n).outputs:
            n_out += len(c.token_ids)
            choices.append({"index": i * body.n + c.index, "text": c.text, "logprobs": None,
                            "finish_reason": c.finish_reason, "stop_reason": None})
    return {"id": rid, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": _usage(n_prompt, n_out)}


async def beam_chat(state: ServerState, body: ChatCompletionRequest, request: Request,
                    prompt_ids: list[int], model: str) -> dict:
    rid = response_id("chatcmpl", body)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None \
        else body.max_tokens
    searches = await _searches(state, body, engine_id(rid, body), [prompt_ids], max_tokens)
    await unless_disconnected(request, beam.run_async(state.engine, searches, body.priority))
    outs = searches[0].output(state.engine.tokenizer, body.n).outputs
    choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": None, "finish_reason": c.finish_reason, "stop_reason": None}
               for c in outs]
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": choices,
            "usage": _usage(len(prompt_ids), sum(len(c.token_ids) for c in outs))}
