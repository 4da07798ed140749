"""The asynchronous front end used by the server.

The engine core runs in its own process. Requests go to it over ZeroMQ; one message per engine
step comes back with every request's new tokens, which a single reader task detokenizes and
hands to the per-request streams. Admission control bounds the queue of sequences (a request's
n > 1 samples count one each) that have not produced a token yet, in sequences and in prompt
tokens. A stream whose client reads slowly holds one merged output, never a growing backlog.
A core that has work but has not answered for `engine_timeout_s` makes the engine unhealthy.
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
from octavo.core.protocol import AbortRequests, CoreOutputs, SchedulerStats, Shutdown, UtilityCall
from octavo.engine.core_launch import CoreLaunch, launch_core
from octavo.engine.llm_engine import ModelSetup
from octavo.engine.messages import encoder, output_decoder
from octavo.engine.offload import Offload
from octavo.engine.outputs import OutputProcessor, ParentState
from octavo.engine.processor import PreparedRequest, RequestLimits
from octavo.engine.request_stream import RequestStream
from octavo.metrics import EngineMetrics
from octavo.params import LoRARequest, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)

MIN_QUEUED_TOKENS = 32768  # the default bound on waiting prompt tokens never goes below this


class EngineDeadError(RuntimeError):
    """The engine-core process is gone; no request can be served any more."""


class QueueFullError(RuntimeError):
    """Admission control refused a request; the server answers 429 with Retry-After."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class ServingLimits:
    """The server's bounds on its front end (`octavo serve` flags of the same names)."""

    max_queued_requests: int | None = None  # sequences without a token yet; default 4 x seqs
    max_queued_tokens: int | None = None  # their prompt tokens; default 16 x step budget
    request: RequestLimits = field(default_factory=RequestLimits)
    preprocess_timeout_s: float = 30.0  # tokenizing, rendering, grammar checks of one request
    engine_timeout_s: float = 60.0  # a core with work silent this long is hung: /health 503


class AsyncEngine:
    def __init__(self, config: EngineConfig, limits: ServingLimits | None = None,
                 core: CoreLaunch | None = None) -> None:
        """`core`: a core process already launched for `config` (`octavo serve` starts it
        before importing this module); by default one starts here. It imports torch while this
        process reads the model's config and tokenizer, then gets what it needs from them
        through its setup pipe."""
        self.config = config
        self.limits = limits = limits or ServingLimits()
        self.core = core or launch_core(config)
        self._bind_sockets()
        try:
            self.setup = ModelSetup.load(config, limits.request)
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
        self.max_queued_requests = limits.max_queued_requests or 4 * sched.max_num_seqs
        self.max_queued_tokens = limits.max_queued_tokens or max(
            MIN_QUEUED_TOKENS, 16 * sched.max_num_batched_tokens)
        self.offload = Offload(limits.preprocess_timeout_s)
        self.stats = SchedulerStats(0, 0, 0.0, 0)
        self.dead: str | None = None
        self._streams: dict[str, RequestStream] = {}
        self._queued_requests = 0
        self._queued_tokens = 0
        self._calls = itertools.count()
        self._pending_calls: dict[int, asyncio.Future] = {}
        self._last_heard = time.monotonic()  # the core's last message

    # -- process and sockets ---------------------------------------------------------------------

    def _bind_sockets(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self._to_core = self.ctx.socket(zmq.PUSH)
        self._to_core.bind(self.core.input_addr)
        self._from_core = self.ctx.socket(zmq.PULL)
        self._from_core.bind(self.core.output_addr)
        self.num_blocks: int | None = None
        self.loaded = ""  # what the core loaded (Executor.describe), once it is ready
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
            error_type, message = info
            if error_type == "ValueError":  # a bad setting (a KV budget past free memory, ...)
                raise ValueError(message)
            raise RuntimeError(f"engine core failed to start: {error_type}: {message}")
        self.num_blocks = info["num_blocks"]
        self.setup.adopt_max_model_len(info["max_model_len"])  # the core may have cut it
        self.max_model_len = self.setup.max_model_len
        self.loaded = info["loaded"]
        logger.info("start-up: engine core process (pid %d) ready in %.1f s (imports, weights, "
                    "KV cache)", info["pid"], time.perf_counter() - self.core.started)

    def start_background(self) -> None:
        """Start the output reader and the process watchdog on the running event loop (again
        on a new loop: a caller's `asyncio.run` per call closes the old one with its tasks)."""
        self.wait_until_ready()
        loop = asyncio.get_running_loop()
        if self._reader is None or self._reader.get_loop() is not loop or self._reader.done():
            self.metrics.watch_frontend(lambda: len(self._streams),
                                        lambda: self._queued_requests,
                                        lambda: self._queued_tokens,
                                        lambda: len(asyncio.all_tasks(loop)))
            self._reader = loop.create_task(self._read_outputs())
            self._watchdog = loop.create_task(self._watch_process())

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
            stream.put(EngineDeadError(reason))
        for fut in self._pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))

    async def _read_outputs(self) -> None:
        try:
            while True:
                msg: CoreOutputs = output_decoder.decode(await self._from_core.recv())
                self._last_heard = time.monotonic()
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
            self.metrics.tokens(prompt_tokens, sum(len(c.token_ids) for c in out.outputs),
                                stream.lora_name)
            if stream.first_token is None and any(c.token_ids for c in out.outputs):
                stream.first_token = now
                self.metrics.first_token(now - stream.arrival, parent.first_scheduled_time and
                                         parent.first_scheduled_time - stream.arrival)
            if out.finished:
                self._finish_metrics(parent, stream, now)
                del self._streams[parent.request_id]
            stream.put(out)

    def _finish_metrics(self, parent: ParentState, stream: RequestStream, now: float) -> None:
        outs = parent.children.values()
        n_out = sum(len(c.token_ids) for c in outs)
        self.metrics.finished([c.finish_reason for c in outs], n_out, now - stream.arrival,
                              None if stream.first_token is None else now - stream.first_token,
                              stream.lora_name)

    def _dequeue(self, stream: RequestStream) -> None:
        stream.queued = False
        self._queued_requests -= stream.sequences
        self._queued_tokens -= stream.prompt_tokens

    @property
    def queued(self) -> tuple[int, int]:
        """(sequences, prompt tokens) admitted and waiting for their first token."""
        return self._queued_requests, self._queued_tokens

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    def hung(self) -> str | None:
        """Why the core counts as hung (it has work and has said nothing for
        engine_timeout_s), else None."""
        silent = time.monotonic() - self._last_heard
        if self._streams and silent > self.limits.engine_timeout_s:
            return (f"the engine core has not answered for {silent:.0f} s with "
                    f"{len(self._streams)} requests in flight")
        return None

    # -- requests --------------------------------------------------------------------------------

    def prepare(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams,
                priority: int = 0, cache_salt: str | None = None,
                max_logprobs: int | None = None, add_special_tokens: bool = True,
                lora_request: LoRARequest | None = None) -> PreparedRequest:
        """Validate and tokenize here (raises ValueError on bad input): for prompts that are
        token ids already; text goes through `prepare_async`."""
        return self.processor.build(request_id, prompt, params, priority, cache_salt,
                                    max_logprobs, add_special_tokens, lora_request)

    async def prepare_async(self, request_id: str, prompt: str | Sequence[int],
                            params: SamplingParams, priority: int = 0,
                            cache_salt: str | None = None,
                            add_special_tokens: bool = True,
                            lora_request: LoRARequest | None = None) -> PreparedRequest:
        """`prepare` off the event loop, within the preprocess budget."""
        return await self.offload.run("tokenizing and checking the request", self.prepare,
                                      request_id, prompt, params, priority, cache_salt, None,
                                      add_special_tokens, lora_request)

    def generate(self, prepared: PreparedRequest) -> AsyncIterator[RequestOutput]:
        """Admit the request (or raise QueueFullError / EngineDeadError now, before any
        response is started) and return the stream of its outputs; each carries the text and
        tokens new since the last. Leaving the stream early (client gone, task cancelled)
        aborts the request."""
        if self.dead:
            raise EngineDeadError(self.dead)
        self.metrics.received.inc()
        try:
            messages = self._admit(prepared)
        except BaseException:
            self.metrics.rejected()
            raise
        sequences = len(prepared.core_requests)
        tokens = len(prepared.prompt_token_ids) * sequences
        lora = prepared.core_requests[0].lora_request
        stream = RequestStream(sequences=sequences, prompt_tokens=tokens,
                               lora_name=None if lora is None else lora.lora_name)
        self._streams[prepared.request_id] = stream
        self._queued_requests += sequences
        self._queued_tokens += tokens
        try:
            self.outputs.add_request(prepared)
            for msg in messages:
                self._to_core.send(msg)  # queued, not awaited
        except BaseException:
            self.abort(prepared.request_id)
            raise
        return self._iterate(prepared.request_id, stream)

    def _admit(self, prepared: PreparedRequest) -> list[bytes]:
        """The admission checks, then the request's messages to the core: encoded before
        anything is registered, so a request that cannot cross to the core is refused here and
        leaves no stream, counter or output state behind."""
        if prepared.request_id in self._streams:
            raise ValueError(f"request id {prepared.request_id!r} is already in use")
        sequences = len(prepared.core_requests)
        tokens = len(prepared.prompt_token_ids) * sequences
        self.check_admissible(sequences)
        if self._queued_requests + sequences > self.max_queued_requests:
            raise QueueFullError(f"server busy: {self._queued_requests} sequences are queued "
                                 f"(max_queued_requests={self.max_queued_requests})")
        if self._queued_requests and self._queued_tokens + tokens > self.max_queued_tokens:
            raise QueueFullError(f"server busy: {self._queued_tokens} prompt tokens are queued "
                                 f"(max_queued_tokens={self.max_queued_tokens})")
        return [encoder.encode(req) for req in prepared.core_requests]

    def check_size(self, prompts: int, n: int, best_of: int | None = None) -> None:
        """Before any tokenizing: n and best_of within --max-n, and the request's sequences
        within what the queue may ever hold (ValueError)."""
        limits = self.limits.request
        limits.check_width("n", n)
        if best_of is not None:
            limits.check_width("best_of", best_of)
        self.check_admissible(prompts * max(n, best_of or 1))

    def check_admissible(self, sequences: int) -> None:
        """Refuse (ValueError: a 400, not a 429 to retry) a request of more sequences than the
        queue may ever hold."""
        if sequences > self.max_queued_requests:
            raise ValueError(f"the request asks for {sequences} sequences (prompts x n); at "
                             f"most {self.max_queued_requests} can be queued at once "
                             f"(max_queued_requests)")

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

    async def _iterate(self, request_id: str,
                       stream: RequestStream) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await stream.get()
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
        if stream is None:
            return  # finished, or aborted already
        if stream.queued:
            self._dequeue(stream)
        children = self.outputs.child_ids(request_id)
        final = self.outputs.abort(request_id, delta=True)
        if final is not None:  # a reader waiting on the stream (an abort from elsewhere) ends
            stream.put(final)
        self.metrics.aborted()
        if children and not self.dead:
            self._to_core.send(encoder.encode(AbortRequests(children)))  # queued, not awaited

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
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop the core and release everything, from any thread and with or without an event
        loop (`shutdown` cancels this loop's tasks first)."""
        self.offload.shutdown()
        if self.core.process.is_alive():
            try:  # a plain socket over the same handle: no event loop is needed to send
                zmq.Socket.shadow(self._to_core.underlying).send(encoder.encode(Shutdown()))
            except zmq.ZMQError:
                pass
            self.core.process.join(10)
            if self.core.process.is_alive():
                self.core.process.kill()
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self.ctx.term()
        self.core.remove_ipc_dir()
