"""Messages between the front-end process and the engine-core process (msgpack via msgspec).

Core outputs travel as the core's own dataclasses; numpy arrays inside them are packed as
(dtype, shape, bytes).
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec
import numpy as np

from octavo.core.request import Request
from octavo.core.scheduler import EngineCoreOutput, SchedulerStats
from octavo.params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    req_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams constructor arguments
    eos_token_ids: list[int]
    max_tokens: int
    priority: int
    arrival_time: float
    cache_salt: str | None = None
    bad_words_token_ids: list[list[int]] = []

    @classmethod
    def of(cls, req: Request, arrival_time: float) -> AddRequest:
        p = req.sampling_params
        params = {f.name: getattr(p, f.name) for f in fields(p) if f.init}
        if p.structured_outputs is not None:  # rebuilt by SamplingParams from the dict
            params["structured_outputs"] = p.structured_outputs.to_dict()
        return cls(req.req_id, req.prompt_token_ids, params,
                   sorted(req.eos_token_ids), req.max_tokens, req.priority, arrival_time,
                   req.cache_salt, req.bad_words_token_ids)

    def to_request(self) -> Request:
        params = dict(self.params)
        if params.get("logit_bias"):
            params["logit_bias"] = {int(k): v for k, v in params["logit_bias"].items()}
        return Request(self.req_id, self.prompt_token_ids, SamplingParams(**params),
                       frozenset(self.eos_token_ids), self.max_tokens, priority=self.priority,
                       arrival_time=self.arrival_time, cache_salt=self.cache_salt,
                       bad_words_token_ids=self.bad_words_token_ids)


class AbortRequests(msgspec.Struct, tag=True):
    req_ids: list[str]


class UtilityCall(msgspec.Struct, tag=True):
    call_id: int
    method: str  # "stats" or "reset_prefix_cache"


class Shutdown(msgspec.Struct, tag=True):
    pass


CoreInput = AddRequest | AbortRequests | UtilityCall | Shutdown


class CoreOutputs(msgspec.Struct):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    utility_call_id: int | None = None
    utility_result: Any = None
    utility_error: str | None = None


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        return (obj.dtype.str, list(obj.shape), obj.tobytes())
    if isinstance(obj, (np.integer, np.floating)):
        return obj.item()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype, shape, data = obj
        return np.frombuffer(data, dtype=dtype).reshape(shape)
    raise NotImplementedError(f"cannot decode {kind}")


encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
input_decoder = msgspec.msgpack.Decoder(CoreInput)
output_decoder = msgspec.msgpack.Decoder(CoreOutputs, dec_hook=_dec_hook)
