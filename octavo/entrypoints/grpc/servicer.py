"""The octavo.v1.Octavo service: each RPC on the server's one AsyncEngine, with the same checks,
limits and errors as the HTTP routes (an APIError or a ValueError is the status that mirrors
its HTTP one, convert.STATUS_CODES). A call the client cancels is a cancelled task here, which
aborts its requests (AsyncEngine streams abort when left)."""
from __future__ import annotations

import functools
import uuid

import grpc

import octavo
from octavo.engine.async_engine import EngineDeadError, QueueFullError
from octavo.entrypoints.chat_plan import check_output_spec, model_defaults
from octavo.entrypoints.grpc import convert
from octavo.entrypoints.grpc import octavo_pb2 as pb
from octavo.entrypoints.grpc import octavo_pb2_grpc as pb_grpc
from octavo.entrypoints.http import (
    APIError, RequestTimedOut, ServerState, adapter_of, check_model, detokenize_ids, stream_error,
    timed)
from octavo.entrypoints.openai.pooled import pooling_params, run_pooling


def _status(exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status and message an exception ends a call with (None: not one of ours)."""
    if isinstance(exc, APIError):
        param = exc.param
        message = exc.message if not param or exc.message.startswith(param) \
            else f"{param}: {exc.message}"
        return convert.STATUS_CODES.get(exc.status, grpc.StatusCode.UNKNOWN), message
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, QueueFullError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, (EngineDeadError, RequestTimedOut)):
        status, message = stream_error(exc)
        return convert.STATUS_CODES[status], message
    return None


async def _end_with(context, exc: Exception) -> None:
    """End the call with the status that mirrors `exc`; anything else is re-raised (grpc
    reports it as UNKNOWN)."""
    status = _status(exc)
    if status is None:
        raise exc
    await context.abort(*status)


def _unary(method):
    @functools.wraps(method)
    async def call(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:
            await _end_with(context, exc)
    return call


def _streaming(method):
    @functools.wraps(method)
    async def call(self, request, context):
        try:
            async for reply in method(self, request, context):
                yield reply
        except Exception as exc:
            await _end_with(context, exc)
    return call


class OctavoServicer(pb_grpc.OctavoServicer):
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.running: dict[str, list[str]] = {}  # a call's request_id -> its engine requests

    def _claim(self, request_id: str, engine_ids: list[str]) -> str:
        """Register a call's engine requests under its id (Abort's), a random one if none."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.running:
            raise ValueError(f"request_id {request_id!r:.80} is already running")
        self.running[request_id] = engine_ids
        return request_id

    @_streaming
    async def Generate(self, request: pb.GenerateRequest, context):
        state, engine = self.state, self.state.engine
        model = request.model or None
        check_model(state, model)
        msg = request.sampling_params
        spec = convert.structured_outputs(msg)
        await check_output_spec(state, spec, None, "sampling_params.structured_outputs")
        params = convert.sampling_params(msg, model_defaults(state), spec)
        engine.check_size(1, params.n, params.best_of)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") \
            else True
        engine_ids: list[str] = []
        request_id = self._claim(request.request_id, engine_ids)
        try:
            engine_ids.append(f"grpc-{request_id}.{uuid.uuid4().hex[:16]}")
            prepared = await engine.prepare_async(
                engine_ids[0], convert.prompt_of(request), params, request.priority,
                request.cache_salt or None, add_special, adapter_of(state, model))
            responses = convert.ResponseBuilder(request_id)
            async for out in timed(state, engine.generate(prepared)):
                reply = responses.response(out)
                if reply is not None:
                    yield reply
        finally:
            self.running.pop(request_id, None)

    @_unary
    async def Embed(self, request: pb.EmbedRequest, context) -> pb.EmbedResponse:
        state = self.state
        check_model(state, request.model or None)
        params = pooling_params(dimensions=convert.optional(request, "dimensions"),
                                normalize=convert.optional(request, "normalize"),
                                truncate_prompt_tokens=convert.optional(
                                    request, "truncate_prompt_tokens"))
        prompts = [convert.prompt_of(item) for item in request.inputs]
        base = f"grpc-embd-{uuid.uuid4().hex}"
        request_id = self._claim(request.request_id, [f"{base}-{i}"
                                                      for i in range(len(prompts))])
        try:
            outs, tokens = await run_pooling(state, None, base, prompts, params,
                                             field="inputs", priority=request.priority)
        finally:
            self.running.pop(request_id, None)
        return pb.EmbedResponse(embeddings=[pb.Embedding(values=out.outputs.data.tolist())
                                            for out in outs], prompt_tokens=tokens)

    @_unary
    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        state = self.state
        check_model(state, request.model or None)
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") \
            else True
        ids = await state.engine.offload.run("tokenizing the prompt", state.engine.tokenizer.encode,
                                             request.text, add_special)
        return pb.TokenizeResponse(token_ids=ids, max_model_len=state.engine.max_model_len)

    @_unary
    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        check_model(self.state, request.model or None)
        skip = bool(convert.optional(request, "skip_special_tokens"))
        return pb.DetokenizeResponse(text=await detokenize_ids(
            self.state, list(request.token_ids), "token_ids", skip))

    @_unary
    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        engine = self.state.engine
        return pb.ModelInfo(served_model_names=self.state.served_model_names,
                            model=engine.config.model.model,
                            max_model_len=engine.max_model_len,
                            vocab_size=engine.processor.vocab_size,
                            task="generate" if engine.processor.generates else "embed",
                            lora_adapters=list(engine.processor.adapters.named),
                            version=octavo.__version__)

    @_unary
    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        aborted = 0
        for request_id in request.request_ids:
            engine_ids = self.running.get(request_id)
            if engine_ids is None:
                continue
            aborted += 1
            for engine_id in engine_ids:
                self.state.engine.abort(engine_id)
        return pb.AbortResponse(aborted=aborted)
