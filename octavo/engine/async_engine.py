"""The asynchronous front end used by the server.

The engine core runs in its own process. Requests go to it over ZeroMQ; one message per engine
step comes back with every request's new tokens, which a single reader task detokenizes and
hands to the per-request streams. Admission control bounds the queue of requests that have not
produced a token yet, in requests and in prompt tokens.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from octavo.config import EngineConfig
from octavo.core.scheduler import SchedulerStats
from octavo.engine.core_launch import CoreLaunch, launch_core
from octavo.engine.llm_engine import ModelSetup
from octavo.engine.messages import (
    AbortRequests, AddRequest, CoreOutputs, Shutdown, UtilityCall, encoder, output_decoder)
from octavo.engine.outputs import OutputProcessor, ParentState
from octavo.engine.processor import MAX_LOGPROBS, PreparedRequest
from octavo.metrics import EngineMetrics
from octavo.params import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

MIN_QUEUED_TOKENS = 32768  # the default bound on waiting prompt tokens never goes below this


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class QueueFullError(RuntimeError):
    """Admission control refused a request; the server answers 429 with Retry-After."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class _Stream:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_tokens: int = 0
    queued: bool = True  # no output yet: counts against the admission bounds
    arrival: float = field(default_factory=time.time)
    first_token: float | None = None


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_queued_requests: int | None = None,
                 max_queued_tokens: int | None = None, core: CoreLaunch | None = None) -> None:
        """`core`: a core process already launched for `config` (`octavo serve` starts it
        before importing this module); by default one starts here. It imports torch while this
        process reads the model's config and tokenizer, then gets what it needs from them
        through its setup pipe."""
        self.config = config
        self.core = core or launch_core(config)
        self._bind_sockets()
        try:
            self.setup = ModelSetup.load(config)
        except BaseException:
            self.core.abandon()
            self._close_sockets()
            raise
        self.core.setup.send(self.setup.core_args())
        self.core.setup.close()
        self.tokenizer = self.setup.tokenizer
        self.processor = self.setup.processor
        self.max_model_len = self.setup.max_model_len
        self.outputs = OutputProcessor(self.tokenizer)
        self.metrics = EngineMetrics()
        sched = config.scheduler
        self.max_queued_requests = max_queued_requests or 4 * sched.max_num_seqs
        self.max_queued_tokens = max_queued_tokens or max(MIN_QUEUED_TOKENS,
                                                          16 * sched.max_num_batched_tokens)
        self.stats = SchedulerStats(0, 0, 0.0, 0)
        self.dead: str | None = None
        self._streams: dict[str, _Stream] = {}
        self._queued_requests = 0
        self._queued_tokens = 0
        self._calls = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}

    # -- process and sockets ---------------------------------------------------------------------

    def _bind_sockets(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._to_core = self.ctx.socket(zmq.PUSH)
        self._to_core.bind(self.core.input_addr)
        self._from_core = self.ctx.socket(zmq.PULL)
        self._from_core.bind(self.core.output_addr)
        self.num_blocks: int | None = None
        self._reader: asyncio.Task | None = None
        self._watchdog: asyncio.Task | None = None

    def wait_until_ready(self) -> None:
        """Block until the core process has loaded the model (the caller may do its own set-up
        meanwhile: the core imports torch and loads weights on its own cores)."""
        if self.num_blocks is not None:
            return
        while not self.core.ready.poll(1.0):
            if not self.core.process.is_alive():
                raise RuntimeError(f"engine core exited during start-up "
                                   f"(code {self.core.process.exitcode})")
        kind, info = self.core.ready.recv()
        if kind != "ready":
            self.core.process.join(5)
            raise RuntimeError(f"engine core failed to start: {info}")
        self.num_blocks = info["num_blocks"]
        logger.info("start-up: engine core process (pid %d) ready in %.1f s (imports, weights, "
                    "KV cache)", info["pid"], time.perf_counter() - self.core.started)

    def start_background(self) -> None:
        """Start the output reader and the process watchdog on the running event loop."""
        self.wait_until_ready()
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_outputs())
            self._watchdog = asyncio.get_running_loop().create_task(self._watch_process())

    async def _send(self, msg) -> None:
        if self.dead:
            raise EngineDeadError(self.dead)
        await self._to_core.send(encoder.encode(msg))

    async def _watch_process(self) -> None:
        while self.core.process.is_alive():
            await asyncio.sleep(0.2)
        if self.dead is None:
            self._die(f"engine core process exited (code {self.core.process.exitcode})")

    def _die(self, reason: str) -> None:
        logger.error("%s", reason)
        self.dead = reason
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDeadError(reason))
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def _read_outputs(self) -> None:
        try:
            while True:
                msg: CoreOutputs = output_decoder.decode(await self._from_core.recv())
                self._on_outputs(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave clients hanging
            logger.exception("output reader failed")
            self._die(f"output reader failed: {exc}")

    def _on_outputs(self, msg: CoreOutputs) -> None:
        self.stats = msg.stats
        self.metrics.observe_stats(msg.stats)
        if msg.utility_call_id is not None:
            fut = self._pending_calls.pop(msg.utility_call_id, None)
            if fut and not fut.done():
                if msg.utility_error:
                    fut.set_exception(RuntimeError(msg.utility_error))
                else:
                    fut.set_result(msg.utility_result)
        if not msg.outputs:
            return
        changed, to_abort = self.outputs.process(msg.outputs)
        if to_abort and not self.dead:
            self._to_core.send(encoder.encode(AbortRequests(to_abort)))  # queued, not awaited
        now = time.time()
        for parent in changed:
            stream = self._streams.get(parent.request_id)
            if stream is None:
                continue
            prompt_tokens = 0
            if stream.queued:
                self._dequeue(stream)
                prompt_tokens = stream.prompt_tokens
            out = parent.output(delta=True)
            self.metrics.tokens(prompt_tokens, sum(len(c.token_ids) for c in out.outputs))
            if stream.first_token is None and any(c.token_ids for c in out.outputs):
                stream.first_token = now
                self.metrics.first_token(now - stream.arrival, parent.first_scheduled_time and
                                         parent.first_scheduled_time - stream.arrival)
            if out.finished:
                self._finish_metrics(parent, stream, now)
                del self._streams[parent.request_id]
            stream.queue.put_nowait(out)

    def _finish_metrics(self, parent: ParentState, stream: _Stream, now: float) -> None:
        outs = parent.children.values()
        n_out = sum(len(c.token_ids) for c in outs)
        self.metrics.finished([c.finish_reason for c in outs], n_out, now - stream.arrival,
                              None if stream.first_token is None else now - stream.first_token)

    def _dequeue(self, stream: _Stream) -> None:
        stream.queued = False
        self._queued_requests -= 1
        self._queued_tokens -= stream.prompt_tokens

    # -- requests --------------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                priority: int = 0, cache_salt: str | None = None,
                max_logprobs: int = MAX_LOGPROBS) -> PreparedRequest:
        """Validate and tokenize (raises ValueError on bad input)."""
        return self.processor.build(request_id, prompt, params, priority, cache_salt,
                                    max_logprobs)

    def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Admit the request (or raise QueueFullError / EngineDeadError now, before any
        response is started) and return the stream of its outputs; each carries the text and
        tokens new since the last. Leaving the stream early (client gone, task cancelled)
        aborts the request."""
        if self.dead:
            raise EngineDeadError(self.dead)
        tokens = len(prepared.prompt_token_ids) * len(prepared.core_requests)
        if self._queued_requests >= self.max_queued_requests:
            self.metrics.rejected()
            raise QueueFullError(f"server busy: {self._queued_requests} requests are queued "
                                 f"(max_queued_requests={self.max_queued_requests})")
        if self._queued_requests and self._queued_tokens + tokens > self.max_queued_tokens:
            self.metrics.rejected()
            raise QueueFullError(f"server busy: {self._queued_tokens} prompt tokens are queued "
                                 f"(max_queued_tokens={self.max_queued_tokens})")
        stream = _Stream(prompt_tokens=tokens)
        self._streams[prepared.request_id] = stream
        self._queued_requests += 1
        self._queued_tokens += tokens
        self.outputs.add_request(prepared)
        for req in prepared.core_requests:
            self._to_core.send(encoder.encode(AddRequest.of(req, req.arrival_time)))
        return self._iterate(prepared.request_id, stream)

    def generate_all(self, prepared: list[PreparedRequest]) -> list[AsyncIterator[RequestOutput]]:
        """Admit every request or none."""
        streams = []
        try:
            for p in prepared:
                streams.append(self.generate(p))
        except Exception:
            for p in prepared[:len(streams)]:
                self.abort(p.request_id)
            raise
        return streams

    async def _iterate(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Drop a request (client gone); its blocks are freed at the core's next step. Sync, so
        that it also runs inside a cancelled task."""
        stream = self._streams.pop(request_id, None)
        if stream is not None and stream.queued:
            self._dequeue(stream)
        children = self.outputs.child_ids(request_id)
        self.outputs.abort(request_id)
        if children and not self.dead:
            self._to_core.send(encoder.encode(AbortRequests(children)))  # queued, not awaited
            self.metrics.aborted()

    async def call_utility(self, method: str):
        call_id = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        self._pending_calls[call_id] = fut
        try:
            await self._send(UtilityCall(call_id, method))
            return await fut
        finally:
            self._pending_calls.pop(call_id, None)

    async def shutdown(self) -> None:
        for task in (self._reader, self._watchdog):
            if task:
                task.cancel()
        if self.core.process.is_alive():
            try:
                await self._to_core.send(encoder.encode(Shutdown()))
            except zmq.ZMQError:
                pass
            await asyncio.get_running_loop().run_in_executor(None, self.core.process.join, 10)
            if self.core.process.is_alive():
                self.core.process.kill()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self.ctx.term()
        self.core.remove_ipc_dir()
