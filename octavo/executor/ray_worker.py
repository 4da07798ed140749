"""One rank under the ray executor: the class its Ray actor is made of. It takes and returns only
bytes (the wire messages, encoded by msgspec), so Ray pickles no contract object; the actor runs
one call at a time, in the order the executor sent them."""
from __future__ import annotations

import logging

from octavo.distributed import ray_cluster
from octavo.distributed.lockstep import free_port
from octavo.executor import wire
from octavo.executor.rank_worker import RankWorker


class RayRankWorker:
    def __init__(self) -> None:
        self.rank: RankWorker | None = None

    def where(self) -> tuple[str, str, int]:
        """(Ray node id, node IP address, pid) of this actor."""
        return ray_cluster.where()

    def free_port(self) -> int:
        """A TCP port free now on this node, for the ranks' torch.distributed rendezvous."""
        return free_port("")

    def start(self, spec: bytes) -> bytes:
        """Build and load the rank's Worker: the ready reply (or the failure)."""
        decoded = wire.spec_decoder.decode(spec)
        logging.basicConfig(level=decoded.log_level,
                            format=f"%(levelname)s rank{decoded.rank} %(name)s: %(message)s")
        self.rank = RankWorker(decoded)
        return self.rank.start()[0]

    def call(self, payload: bytes) -> bytes:
        if self.rank is None:
            raise RuntimeError("a call before the rank was started")
        reply, stop = self.rank.answer(payload)
        if stop:
            self.rank.close()
        return reply
