"""One rank's worker process under the mp executor (`python -m octavo.executor.mp_worker`, its
`WorkerSpec` on stdin): builds the rank's Worker, then answers the executor's calls over ZeroMQ
until told to stop. It dies with the process that started it (PR_SET_PDEATHSIG, and a parent
check whenever it has waited a second for a call)."""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

import zmq

from octavo.executor import wire
from octavo.lifetime import die_with_parent

logger = logging.getLogger(__name__)

PARENT_CHECK_MS = 1000


def rank_identity(rank: int) -> bytes:
    """The rank's ZeroMQ identity on the executor's ROUTER socket."""
    return f"rank-{rank}".encode()


def main() -> int:
    die_with_parent()
    spec = wire.spec_decoder.decode(sys.stdin.buffer.read())
    if os.getppid() != spec.parent_pid:  # the executor died before the line above
        return 1
    # The executor owns SIGINT (a terminal's Ctrl-C reaches the whole process group) and stops
    # the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(levelname)s rank{spec.rank} %(name)s: %(message)s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank_identity(spec.rank))
    sock.setsockopt(zmq.LINGER, 1000)  # the last reply (an error, a shutdown ack) gets out
    sock.connect(spec.address)
    try:
        return _serve(spec, sock)
    finally:
        sock.close()
        ctx.term()


def _serve(spec: wire.WorkerSpec, sock: zmq.Socket) -> int:
    from octavo.distributed import parallel_state
    from octavo.distributed.parallel_state import RankPlacement
    from octavo.worker.worker import Worker

    def send(reply: wire.Reply | wire.ExecuteReply) -> None:
        sock.send(wire.encoder.encode(reply), copy=False)

    try:
        worker = Worker(spec.config, spec.source, spec.arch, spec.max_model_len,
                        spec.eos_token_ids,
                        placement=RankPlacement(spec.rank, spec.tp_size, spec.pp_size),
                        distributed_init_method=spec.distributed_init_method)
        worker.load_model()
    except BaseException:
        send(wire.Reply(spec.rank, wire.READY_CALL_ID, error=traceback.format_exc()))
        return 1
    send(wire.Reply(spec.rank, wire.READY_CALL_ID))
    output_rank = (spec.pp_size - 1) * spec.tp_size  # the last stage's first tp rank samples
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(PARENT_CHECK_MS):
                if os.getppid() != spec.parent_pid:
                    logger.error("the executor (pid %d) is gone; rank %d exits",
                                 spec.parent_pid, spec.rank)
                    return 1
                continue
            call = wire.call_decoder.decode(sock.recv())
            send(_answer(worker, call, spec.rank, spec.rank == output_rank))
            if isinstance(call, wire.Shutdown):
                return 0
    finally:
        parallel_state.destroy()


def _answer(worker, call: wire.Call, rank: int, is_output_rank: bool):
    try:
        if isinstance(call, wire.Execute):
            out = worker.execute(call.scheduler_output)
            return wire.ExecuteReply(rank, call.call_id, out if is_output_rank else None)
        if isinstance(call, wire.InitKVCache):
            value = worker.init_kv_cache(call.kv_cache_memory, call.block_size)
        elif isinstance(call, wire.KVBytesPerBlock):
            value = worker.kv_bytes_per_block(call.block_size)
        elif isinstance(call, wire.AvailableMemory):
            value = worker.available_memory()
        elif isinstance(call, wire.Describe):
            value = worker.describe()
        elif isinstance(call, wire.DoIdleWork):
            value = worker.do_idle_work()
        elif isinstance(call, wire.Shutdown):
            value = None
        else:
            raise TypeError(f"unknown call {type(call).__name__}")
    except Exception:  # noqa: BLE001 - the executor decides; this rank stays in the loop
        kind = wire.ExecuteReply if isinstance(call, wire.Execute) else wire.Reply
        return kind(rank, call.call_id, error=traceback.format_exc())
    return wire.Reply(rank, call.call_id, value)


if __name__ == "__main__":
    sys.exit(main())
