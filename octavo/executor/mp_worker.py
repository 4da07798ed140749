"""One rank's worker process under the mp executor (`python -m octavo.executor.mp_worker`, its
`ProcessStart` on stdin): builds the rank's Worker (rank_worker.py), then answers the executor's
calls over ZeroMQ until told to stop. It dies with the process that started it
(PR_SET_PDEATHSIG, and a parent check whenever it has waited a second for a call)."""
from __future__ import annotations

import logging
import os
import signal
import sys

import zmq

from octavo.executor import wire
from octavo.executor.rank_worker import RankWorker
from octavo.lifetime import die_with_parent

logger = logging.getLogger(__name__)

PARENT_CHECK_MS = 1000


def rank_identity(rank: int) -> bytes:
    """The rank's ZeroMQ identity on the executor's ROUTER socket."""
    return f"rank-{rank}".encode()


def main() -> int:
    die_with_parent()
    start = wire.start_decoder.decode(sys.stdin.buffer.read())
    if os.getppid() != start.parent_pid:  # the executor died before the line above
        return 1
    spec = start.spec
    # The executor owns SIGINT (a terminal's Ctrl-C reaches the whole process group) and stops
    # the workers itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=spec.log_level,
                        format=f"%(levelname)s rank{spec.rank} %(name)s: %(message)s")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, rank_identity(spec.rank))
    sock.setsockopt(zmq.LINGER, 1000)  # the last reply (an error, a shutdown ack) gets out
    sock.connect(start.address)
    try:
        return _serve(RankWorker(spec), start.parent_pid, sock)
    finally:
        sock.close()
        ctx.term()


def _serve(rank: RankWorker, parent_pid: int, sock: zmq.Socket) -> int:
    ready, loaded = rank.start()
    sock.send(ready, copy=False)
    if not loaded:
        return 1
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    try:
        while True:
            if not poller.poll(PARENT_CHECK_MS):
                if os.getppid() != parent_pid:
                    logger.error("the executor (pid %d) is gone; rank %d exits", parent_pid,
                                 rank.spec.rank)
                    return 1
                continue
            reply, stop = rank.answer(sock.recv())
            sock.send(reply, copy=False)
            if stop:
                return 0
    finally:
        rank.close()


if __name__ == "__main__":
    sys.exit(main())
