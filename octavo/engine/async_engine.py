"""The asynchronous front end used by the server.

The engine core runs in its own process. Requests go to it over ZeroMQ; one message per engine
step comes back with every request's new tokens, which a single reader task detokenizes and
hands to the per-request streams. Admission control bounds the queue of sequences (a request's
n > 1 samples count one each) that have not produced a token yet, in sequences and in prompt
tokens. A stream whose client reads slowly holds one merged output, never a growing backlog.
A core that has work but has not answered for `engine_timeout_s` makes the engine unhealthy.
With data parallelism (`--data-parallel-size N`) N cores serve behind this one front end
(core_replica.py), each request placed on one by the router (replica_router.py); a core that
dies fails only its own requests.
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
from octavo.core.protocol import AbortRequests, CoreOutputs, UtilityCall
from octavo.engine.core_launch import CoreLaunch, launch_cores
from octavo.engine.core_replica import CoreReplica, CoreStopper, link
from octavo.engine.llm_engine import ModelSetup
from octavo.engine.messages import encoder, output_decoder
from octavo.engine.offload import Offload
from octavo.engine.outputs import OutputProcessor, ParentState
from octavo.engine.processor import PreparedRequest, RequestLimits
from octavo.engine.replica_router import ReplicaRouter
from octavo.engine.request_stream import RequestStream
from octavo.metrics import EngineMetrics
from octavo.params import LoRARequest, RequestOutput, SamplingParams
from octavo.pooling_params import PoolingParams

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
                 cores: list[CoreLaunch] | None = None) -> None:
        """`cores`: the core processes already launched for `config` (`octavo serve` starts
        them before importing this module), one per data-parallel replica; by default they
        start here. They import torch while this process reads the model's config and
        tokenizer, then get what they need from them through their setup pipes."""
        self.config = config
        self.limits = limits = limits or ServingLimits()
        self._bind_sockets(cores or launch_cores(config))
        try:
            self.setup = ModelSetup.load(config, limits.request)
        except BaseException:
            for replica in self.replicas:
                replica.launch.abandon()
            self._stop_cores()
            raise
        for replica in self.replicas:
            replica.launch.setup.send(self.setup.core_args())
            replica.launch.setup.close()
        self.router = ReplicaRouter(config.core_block_size)
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
        self.dead: str | None = None  # every replica is dead: why
        self._streams: dict[str, RequestStream] = {}
        self._replica_of: dict[str, CoreReplica] = {}  # each stream's replica
        self._queued_requests = 0
        self._queued_tokens = 0
        self._calls = itertools.count()

    # -- process and sockets ---------------------------------------------------------------------

    def _bind_sockets(self, cores: list[CoreLaunch]) -> None:
        self.ctx = zmq.asyncio.Context()
        self.replicas = [CoreReplica(i, core, self.ctx) for i, core in enumerate(cores)]
        if self.config.parallel.experts_span_replicas:
            link(self.replicas)
        self._stop_cores = CoreStopper(self, self.replicas, self.ctx)
        self.num_blocks: int | None = None  # a replica's KV cache blocks, once ready
        self.loaded = ""  # what a core loaded (Executor.describe), once it is ready

    def wait_until_ready(self) -> None:
        """Block until every core process has loaded the model (the caller may do its own
        set-up meanwhile: the cores import torch and load weights on their own cores)."""
        if self.num_blocks is not None:
            return
        for replica in self.replicas:
            replica.wait_until_ready()
            logger.info("start-up: engine core process %d (pid %d) ready in %.1f s (imports, "
                        "weights, KV cache)", replica.index, replica.pid,
                        time.perf_counter() - replica.launch.started)
        # a core may have cut the context to what its KV cache holds: every replica's fits
        self.setup.adopt_max_model_len(min(r.max_model_len for r in self.replicas))
        self.max_model_len = self.setup.max_model_len
        self.num_blocks = min(r.num_blocks for r in self.replicas)
        self.loaded = self.replicas[0].loaded

    def start_background(self) -> None:
        """Start each core's output reader and process watchdog on the running event loop
        (again on a new loop: a caller's `asyncio.run` per call closes the old one with its
        tasks)."""
        self.wait_until_ready()
        loop = asyncio.get_running_loop()
        tasks = self.replicas[0].tasks
        if not tasks or tasks[0].get_loop() is not loop or tasks[0].done():
            self.metrics.watch_frontend(lambda: len(self._streams),
                                        lambda: self._queued_requests,
                                        lambda: self._queued_tokens,
                                        lambda: len(asyncio.all_tasks(loop)))
            self.metrics.watch_replicas(len(self.replicas),
                                        lambda i: self.replicas[i].dead is None)
            for replica in self.replicas:
                replica.tasks = [loop.create_task(self._read_outputs(replica)),
                                 loop.create_task(self._watch_process(replica))]

    async def _watch_process(self, replica: CoreReplica) -> None:
        while replica.process.is_alive():
            await asyncio.sleep(0.2)
        if replica.dead is None:
            self._die(replica, f"engine core process exited (code {replica.process.exitcode})")

    def _die(self, replica: CoreReplica, reason: str) -> None:
        """The replica's requests and utility calls fail; the others' go on, but for those
        linked to it (its experts were theirs too): they are stopped and fail alike."""
        if len(self.replicas) > 1:
            reason = f"engine core {replica.index}: {reason}"
        logger.error("%s", reason)
        replica.dead = reason
        for request_id in list(replica.requests):
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.put(EngineDeadError(reason))
        for fut in replica.pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(reason))
        if all(r.dead is not None for r in self.replicas):
            self.dead = reason if len(self.replicas) == 1 else f"every engine core is dead; " \
                                                               f"last: {reason}"
        for other in replica.linked:
            if other.dead is None:
                other.process.kill()
                self._die(other, f"its experts' partner {reason}")

    async def _read_outputs(self, replica: CoreReplica) -> None:
        try:
            while True:
                msg: CoreOutputs = output_decoder.decode(await replica.from_core.recv())
                replica.last_heard = time.monotonic()
                self._on_outputs(replica, msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not leave clients hanging
            logger.exception("output reader failed")
            self._die(replica, f"output reader failed: {exc}")

    def _on_outputs(self, replica: CoreReplica, msg: CoreOutputs) -> None:
        replica.stats = msg.stats
        self.metrics.observe_stats(msg.stats, replica.index)
        if msg.utility_call_id is not None:
            fut = replica.pending_calls.pop(msg.utility_call_id, None)
            if fut and not fut.done():
                if msg.utility_error:
                    fut.set_exception(RuntimeError(msg.utility_error))
                else:
                    fut.set_result(msg.utility_result)
        if not msg.outputs:
            return
        changed, to_abort = self.outputs.process(msg.outputs)
        if to_abort:
            replica.send(encoder.encode(AbortRequests(to_abort)))
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
            new = 0 if parent.pooling else sum(len(c.token_ids) for c in out.outputs)
            self.metrics.tokens(prompt_tokens, new, stream.lora_name)
            if stream.first_token is None and new:
                stream.first_token = now
                self.metrics.first_token(now - stream.arrival, parent.first_scheduled_time and
                                         parent.first_scheduled_time - stream.arrival)
            if out.finished:
                self._finish_metrics(parent, stream, now)
                del self._streams[parent.request_id]
                self._replica_of.pop(parent.request_id, replica).release(parent.request_id,
                                                                         stream.sequences)
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
        """Why the engine counts as hung: every live core has work and has said nothing for
        engine_timeout_s (one that still answers keeps serving); else None."""
        reasons = []
        for replica in self.replicas:
            if replica.dead is not None:
                continue
            silent = replica.silent_for()
            if not (replica.requests and silent > self.limits.engine_timeout_s):
                return None
            core = "the engine core" if len(self.replicas) == 1 else \
                f"engine core {replica.index}"
            reasons.append(f"{core} has not answered for {silent:.0f} s with "
                           f"{len(replica.requests)} requests in flight")
        return "; ".join(reasons) or None

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

    async def prepare_pooling_async(self, request_id: str, prompt: str | Sequence[int],
                                    params: PoolingParams, pair: str | None = None,
                                    priority: int = 0) -> PreparedRequest:
        """A pooling request (an embedding, a classification, with `pair` a score) validated
        and tokenized off the event loop, within the preprocess budget (ValueError on bad
        input); `generate` then runs it, its one output a PoolingRequestOutput."""
        return await self.offload.run("tokenizing and checking the request",
                                      self.processor.build_pooling, request_id, prompt, params,
                                      priority, pair)

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
        first = prepared.core_requests[0]
        replica = self.replicas[self.router.pick(
            prepared.prompt_token_ids,
            [r.sequences if r.dead is None else None for r in self.replicas],
            (lora and lora.lora_int_id, first.cache_salt))]
        self._streams[prepared.request_id] = stream
        self._replica_of[prepared.request_id] = replica
        replica.place(prepared.request_id, sequences)
        self._queued_requests += sequences
        self._queued_tokens += tokens
        try:
            self.outputs.add_request(prepared)
            for msg in messages:
                replica.send(msg)  # queued, not awaited
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
        replica = self._replica_of.pop(request_id, None)
        if replica is not None:
            replica.release(request_id, stream.sequences)
            if children:
                replica.send(encoder.encode(AbortRequests(children)))  # queued, not awaited

    async def call_utility(self, method: str) -> list:
        """`method`'s result from every live core (EngineDeadError with none)."""
        live = [r for r in self.replicas if r.dead is None]
        if not live:
            raise EngineDeadError(self.dead)
        return list(await asyncio.gather(*(self._call(r, method) for r in live)))

    async def _call(self, replica: CoreReplica, method: str):
        call_id = next(self._calls)
        fut = asyncio.get_running_loop().create_future()
        replica.pending_calls[call_id] = fut
        try:
            if replica.dead is not None:
                raise EngineDeadError(replica.dead)
            await replica.to_core.send(encoder.encode(UtilityCall(call_id, method)))
            return await fut
        finally:
            replica.pending_calls.pop(call_id, None)

    async def shutdown(self) -> None:
        for replica in self.replicas:
            for task in replica.tasks:
                task.cancel()
        await asyncio.get_running_loop().run_in_executor(None, self.close)

    def close(self) -> None:
        """Stop the cores and release everything, from any thread and with or without an
        event loop (`shutdown` cancels this loop's tasks first)."""
        self.offload.shutdown()
        self._stop_cores()
