"""vLLM's asynchronous engine surface (`AsyncLLM`, alias `AsyncLLMEngine`) over octavo's
AsyncEngine: the engine core in its own process, `generate` as an async generator of
RequestOutputs (cumulative by default, as in vLLM: each holds the whole text and tokens so far;
`SamplingParams.output_kind` DELTA or FINAL_ONLY), `abort`, `shutdown`.

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="smollm2-135m-instruct"))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1"):
        print(out.outputs[0].text)
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from octavo.config import DEFAULT_MODEL
from octavo.engine.arg_utils import EngineArgs, engine_config
from octavo.engine.async_engine import AsyncEngine, ServingLimits
from octavo.engine.request_stream import merge_outputs
from octavo.inputs import PromptType
from octavo.params import RequestOutput, RequestOutputKind, SamplingParams


class AsyncLLM:
    def __init__(self, model: str | None = None, limits: ServingLimits | None = None,
                 **engine_options: Any) -> None:
        """Starts the engine core and waits until it has loaded the model."""
        config = engine_config(model or DEFAULT_MODEL, **engine_options)
        self.engine = AsyncEngine(config, limits)
        self.engine.wait_until_ready()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> AsyncLLM:
        return cls(engine_args.model, **engine_args.options)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams,
                       request_id: str, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come, as `sampling_params.output_kind` says:
        cumulative (the default), deltas, or only the final one; the last has finished=True.
        Leaving the loop early (break, cancel) aborts the request."""
        self.engine.start_background()
        prepared = await self.engine.prepare_async(request_id, prompt, sampling_params,
                                                   priority)
        kind = sampling_params.output_kind
        total: RequestOutput | None = None
        async for delta in self.engine.generate(prepared):
            if kind == RequestOutputKind.DELTA:
                yield delta
                continue
            total = delta if total is None else merge_outputs(total, delta)
            if kind == RequestOutputKind.CUMULATIVE or total.finished:
                yield total

    async def abort(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.engine.abort(rid)

    async def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def errored(self) -> bool:
        return self.engine.dead is not None

    def shutdown(self) -> None:
        self.engine.close()


AsyncLLMEngine = AsyncLLM
