"""A test's core Request handed to an EngineCore the way a front end hands it over: as the
protocol's EngineCoreRequest (the core builds its own Request from it)."""
from __future__ import annotations

from octavo.core.engine_core import EngineCore
from octavo.core.protocol import EngineCoreRequest
from octavo.core.request import Request


def as_core_request(req: Request) -> EngineCoreRequest:
    """The message that brings `req` to a core: every field a front end sets."""
    return EngineCoreRequest(req.req_id, req.prompt_token_ids, req.sampling_params,
                             req.eos_token_ids, req.max_tokens, req.arrival_time, req.priority,
                             req.cache_salt, req.bad_words_token_ids, req.lora_request)


def submit(core: EngineCore, req: Request) -> None:
    core.add_request(as_core_request(req))
