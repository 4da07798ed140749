"""How the offline front end reaches its engine cores with data parallelism
(`LLM(..., data_parallel_size=N)`): N core processes, the server's (core_process.py), each a
replica of the model on its share of the cores, spoken to over ZeroMQ in the protocol's
messages as the server's front end speaks to them. A request goes to a replica by the server's
rule (replica_router.py); `step` returns whatever outputs the replicas have sent, waiting for
one where requests are unfinished. It offers InprocClient's methods, so LLMEngine drives either.
"""
from __future__ import annotations

import itertools

import zmq

from octavo.config import EngineConfig
from octavo.core.protocol import (
    AbortRequests,
    CoreOutputs,
    EngineCoreOutput,
    EngineCoreRequest,
    SchedulerStats,
    UtilityCall,
)
from octavo.engine.core_launch import launch_cores
from octavo.engine.core_replica import CoreReplica, CoreStopper, link
from octavo.engine.messages import encoder, output_decoder
from octavo.engine.replica_router import ReplicaRouter

STEP_WAIT_MS = 1000  # a wait for outputs checks the replicas' processes this often


class ReplicaClient:
    def __init__(self, config: EngineConfig, core_args: tuple) -> None:
        self.ctx = zmq.Context()
        launches = launch_cores(config)
        self.replicas = [CoreReplica(i, launch, self.ctx) for i, launch in enumerate(launches)]
        if config.parallel.experts_span_replicas:
            link(self.replicas)
        self._stop_cores = CoreStopper(self, self.replicas, self.ctx)
        for replica in self.replicas:
            replica.launch.setup.send(core_args)
            replica.launch.setup.close()
        try:
            for replica in self.replicas:
                replica.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        self.router = ReplicaRouter(config.core_block_size)
        self.owner: dict[str, CoreReplica] = {}  # each unfinished core request's replica
        self.poller = zmq.Poller()
        for replica in self.replicas:
            self.poller.register(replica.from_core, zmq.POLLIN)
        self._calls = itertools.count()
        self._pending: list[EngineCoreOutput] = []  # outputs read while awaiting a call

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self.replicas)

    def add_request(self, request: EngineCoreRequest) -> None:
        lora = request.lora_request
        replica = self.replicas[self.router.pick(
            request.prompt_token_ids, [r.sequences for r in self.replicas],
            (lora and lora.lora_int_id, request.cache_salt))]
        replica.send(encoder.encode(request))
        replica.place(request.req_id, 1)
        self.owner[request.req_id] = replica

    def abort_requests(self, req_ids: list[str]) -> None:
        by_replica: dict[int, list[str]] = {}
        for req_id in req_ids:
            replica = self.owner.pop(req_id, None)
            if replica is not None:
                replica.release(req_id, 1)
                by_replica.setdefault(replica.index, []).append(req_id)
        for index, ids in by_replica.items():
            self.replicas[index].send(encoder.encode(AbortRequests(ids)))

    def step(self) -> list[EngineCoreOutput]:
        outputs, self._pending = self._pending, []
        if not outputs and self.owner:
            self._receive(outputs, STEP_WAIT_MS)
        self._receive(outputs, 0)  # and whatever else has arrived
        for out in outputs:
            if out.finish_reason is not None:
                replica = self.owner.pop(out.req_id, None)
                if replica is not None:
                    replica.release(out.req_id, 1)
        return outputs

    def _receive(self, outputs: list[EngineCoreOutput], wait_ms: int,
                 call_id: int | None = None) -> CoreOutputs | None:
        """Read what the replicas have sent into `outputs` (waiting up to wait_ms for the first
        message); the answer to utility call `call_id` is returned when it comes."""
        while True:
            ready = dict(self.poller.poll(wait_ms))
            if not ready:
                self._check_alive()
                return None
            for replica in self.replicas:
                if replica.from_core in ready:
                    msg: CoreOutputs = output_decoder.decode(replica.from_core.recv())
                    replica.stats = msg.stats
                    outputs.extend(msg.outputs)
                    if call_id is not None and msg.utility_call_id == call_id:
                        return msg
            if call_id is None:
                return None
            wait_ms = STEP_WAIT_MS

    def _check_alive(self) -> None:
        for replica in self.replicas:
            if replica.dead is None and not replica.process.is_alive():
                # Sends to it are dropped from now on: a send to a socket with no peer would
                # block (the aborts of the failed call's requests, say).
                replica.dead = f"engine core {replica.index} exited (code " \
                               f"{replica.process.exitcode})"
        dead = [r.dead for r in self.replicas if r.dead is not None]
        for replica in self.replicas:  # those linked to a dead one cannot go on without it
            if replica.dead is None and any(other.dead for other in replica.linked):
                replica.process.kill()
                replica.dead = f"engine core {replica.index} stopped: a replica its experts " \
                               f"span is dead"
        if dead:
            raise RuntimeError("; ".join(dead))

    def _call(self, method: str) -> list:
        results = []
        for replica in self.replicas:
            call_id = next(self._calls)
            replica.send(encoder.encode(UtilityCall(call_id, method)))
            answer = None
            while answer is None:
                answer = self._receive(self._pending, STEP_WAIT_MS, call_id)
            if answer.utility_error:
                raise RuntimeError(answer.utility_error)
            results.append(answer.utility_result)
        return results

    def shutdown(self) -> None:
        self._stop_cores()

    def has_unfinished_requests(self) -> bool:
        return bool(self.owner)

    def reset_prefix_cache(self) -> bool:
        return all(self._call("reset_prefix_cache"))

    def stats(self) -> SchedulerStats:
        """The replicas' stats summed (KV usage: their mean)."""
        return sum_stats(self._call("stats"))



def sum_stats(every: list[SchedulerStats]) -> SchedulerStats:
    fields = SchedulerStats.__struct_fields__
    summed = {}
    for name in fields:
        values = [getattr(s, name) for s in every]
        if name == "kv_cache_usage":
            summed[name] = sum(values) / len(values)
        elif isinstance(values[0], list):
            summed[name] = [sum(v) for v in zip(*values)] if all(values) else []
        else:
            summed[name] = sum(values)
    return SchedulerStats(**summed)
