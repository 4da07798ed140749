"""One request's outputs on their way from the output reader to its HTTP handler."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from octavo.params import CompletionOutput, RequestOutput


@dataclass
class RequestStream:
    """One request's outputs on their way to its handler. Deltas that arrive while the handler
    has not taken the last one are merged into it, so a lagging client costs one output."""

    sequences: int = 1  # core requests (n > 1 fans out): each counts for admission
    prompt_tokens: int = 0
    lora_name: str | None = None  # its adapter's (metrics per adapter)
    queued: bool = True  # no output yet: counts against the admission bounds
    arrival: float = field(default_factory=time.time)
    first_token: float | None = None
    pending: RequestOutput | Exception | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | Exception) -> None:
        if isinstance(self.pending, RequestOutput) and isinstance(item, RequestOutput):
            item = merge_outputs(self.pending, item)
        elif isinstance(self.pending, Exception):
            return  # the error stands
        self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | Exception:
        await self.ready.wait()
        item, self.pending = self.pending, None
        self.ready.clear()
        return item


def merge_outputs(first: RequestOutput, then: RequestOutput) -> RequestOutput:
    """Two consecutive delta outputs of one request as one."""
    outs = {c.index: c for c in first.outputs}
    for c in then.outputs:
        was = outs.get(c.index)
        if was is None:
            outs[c.index] = c
            continue
        logprobs = None if was.logprobs is None and c.logprobs is None else \
            (was.logprobs or []) + (c.logprobs or [])
        outs[c.index] = CompletionOutput(c.index, was.text + c.text,
                                         was.token_ids + c.token_ids, c.cumulative_logprob,
                                         logprobs, c.finish_reason, c.stop_reason)
    # A request's outputs all carry its prompt logprobs so far (not a delta): the latest holds
    # them all.
    prompt_lp = first.prompt_logprobs if then.prompt_logprobs is None else then.prompt_logprobs
    return RequestOutput(then.request_id, then.prompt, then.prompt_token_ids, prompt_lp,
                         [outs[i] for i in sorted(outs)], then.finished, then.num_cached_tokens)
