"""One rank's Worker behind the executor's wire calls, for whichever process hosts the rank (an mp
worker process, a Ray actor): it builds the Worker from its `WorkerSpec` and turns each encoded
call into one encoded reply. An exception in a call is its reply's error (with the traceback):
the executor decides what it means, and the rank stays ready for the next call."""
from __future__ import annotations

import logging
import traceback

from octavo.executor import wire

logger = logging.getLogger(__name__)


class RankWorker:
    def __init__(self, spec: wire.WorkerSpec) -> None:
        self.spec = spec
        self.worker = None
        # The last stage's first tp rank samples; its ModelOutput is the one returned.
        self.is_output_rank = spec.rank == spec.config.parallel.output_rank

    def start(self) -> tuple[bytes, bool]:
        """Build and load the rank's Worker (joining the other ranks first): the ready reply (or
        the failure), and whether it loaded."""
        from octavo.distributed.parallel_state import RankPlacement
        from octavo.worker.worker import Worker

        spec = self.spec
        try:
            self.worker = Worker(spec.config, spec.source, spec.arch, spec.max_model_len,
                                 spec.eos_token_ids,
                                 placement=RankPlacement.of(spec.config.parallel, spec.rank),
                                 distributed_init_method=spec.distributed_init_method,
                                 local_rank=spec.local_rank,
                                 local_world_size=spec.local_world_size)
            self.worker.load_model()
        except BaseException:  # noqa: BLE001 - reported to the executor, which fails the start
            return self._encode(wire.Reply(spec.rank, wire.READY_CALL_ID,
                                           error=traceback.format_exc())), False
        return self._encode(wire.Reply(spec.rank, wire.READY_CALL_ID)), True

    def answer(self, payload: bytes) -> tuple[bytes, bool]:
        """The reply to one encoded call, and whether the call was to shut down."""
        call = wire.call_decoder.decode(payload)
        return self._encode(self._answer(call)), isinstance(call, wire.Shutdown)

    def close(self) -> None:
        from octavo.distributed import parallel_state

        parallel_state.destroy()

    def _answer(self, call: wire.Call) -> wire.Reply | wire.ExecuteReply:
        rank, worker = self.spec.rank, self.worker
        try:
            if worker is None:
                raise RuntimeError("the rank's worker was never started")
            if isinstance(call, wire.Execute):
                out = worker.execute(call.scheduler_output)
                return wire.ExecuteReply(rank, call.call_id, out if self.is_output_rank else None)
            if isinstance(call, wire.InitKVCache):
                value = worker.init_kv_cache(call.num_blocks, call.block_size)
            elif isinstance(call, wire.KVBytesPerBlock):
                value = worker.kv_bytes_per_block(call.block_size)
            elif isinstance(call, wire.StateBytes):
                value = worker.state_bytes()
            elif isinstance(call, wire.AvailableMemory):
                value = worker.available_memory()
            elif isinstance(call, wire.Describe):
                value = worker.describe()
            elif isinstance(call, wire.DoIdleWork):
                value = worker.do_idle_work()
            elif isinstance(call, (wire.CheckHealth, wire.Shutdown)):
                value = None
            else:
                raise TypeError(f"unknown call {type(call).__name__}")
        except Exception:  # noqa: BLE001 - the executor decides; this rank stays in the loop
            kind = wire.ExecuteReply if isinstance(call, wire.Execute) else wire.Reply
            return kind(rank, call.call_id, error=traceback.format_exc())
        return wire.Reply(rank, call.call_id, value)

    @staticmethod
    def _encode(reply: wire.Reply | wire.ExecuteReply) -> bytes:
        return wire.encoder.encode(reply)
