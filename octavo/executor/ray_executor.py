"""The ray executor: one Ray actor per rank (ray_worker.py), placed by a placement group of one
bundle per rank ({"CPU": cores per rank} on the CPU, {"GPU": 1} on CUDA) packed on as few nodes
as hold them; every call broadcast and gathered as ranks.py does it, each an encoded wire message
passed to the actors as bytes.

It joins a Ray cluster as distributed/ray_cluster.py says (a local one it started is stopped at
shutdown): `octavo serve ... --distributed-executor-backend ray` on the head of a cluster runs
one model across its machines.

A rank's death is seen when one of its calls' results fails (polled with `ray.wait` and a
timeout, never waited on without one); between steps `check_health` sends every rank a call it
answers at once. Each machine's ranks split that machine's cores (`local_rank` among them).
"""
from __future__ import annotations

import logging
import time

from octavo.arch_config import ArchConfig
from octavo.config import EngineConfig
from octavo.executor import wire
from octavo.distributed.placement import local_ranks
from octavo.distributed.ray_cluster import connect, import_ray, why
from octavo.executor.ranks import RankExecutor, WorkerFailed
from octavo.executor.ray_worker import RayRankWorker
from octavo.model_source import ModelSource

logger = logging.getLogger(__name__)

__all__ = ["RayExecutor", "WorkerFailed"]

PLACEMENT_TIMEOUT_S = 120.0  # for the cluster to find the bundles and the actors to start
HEALTH_TIMEOUT_S = 5.0  # an idle rank answers a health check at once; this long is a hang
SHUTDOWN_GRACE_S = 5.0  # how long ranks may take to answer the shutdown call and to die


class RayExecutor(RankExecutor):
    def __init__(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
                 max_model_len: int, eos_token_ids: list[int]) -> None:
        super().__init__(config)
        self.ray = ray = import_ray()
        self.started_ray = connect(ray)
        self.actors: list = []
        self.pending: dict = {}  # ObjectRef of a call's reply -> its rank
        self.deaths: dict[int, str] = {}  # rank -> how its actor failed
        self.names = [f"worker rank {rank}" for rank in range(self.world_size)]
        self.nodes: list[str] = []  # each rank's Ray node id
        self.placement_group = None
        try:
            self._start(config, source, arch, max_model_len, eos_token_ids)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d actors (%s): %s", self.world_size, self.layout,
                    ", ".join(self.names))

    def _start(self, config: EngineConfig, source: ModelSource, arch: ArchConfig,
               max_model_len: int, eos_token_ids: list[int]) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ray = self.ray
        cpu = config.device.device == "cpu"
        if cpu:
            cores = config.device.num_threads or max(
                1, int(ray.cluster_resources().get("CPU", 1)) // self.world_size)
            bundle, resources = {"CPU": cores}, {"num_cpus": cores}
        else:
            bundle, resources = {"GPU": 1}, {"num_cpus": 0, "num_gpus": 1}
        self.placement_group = placement_group([dict(bundle)] * self.world_size, strategy="PACK")
        ready, _ = ray.wait([self.placement_group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            raise RuntimeError(
                f"the Ray cluster cannot place {self.world_size} ranks of {bundle} each within "
                f"{PLACEMENT_TIMEOUT_S:g} s (it has {ray.cluster_resources()}); add nodes "
                f"with `ray start --address=...` or ask for fewer ranks")
        actor_class = ray.remote(RayRankWorker)
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self.placement_group,
                                                        placement_group_bundle_index=rank)
            self.actors.append(actor_class.options(
                scheduling_strategy=strategy, max_restarts=0, max_task_retries=0,
                **resources).remote())
        try:
            where = ray.get([actor.where.remote() for actor in self.actors],
                            timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.RayError as exc:
            self._fail(f"the rank actors did not start: {why(exc)}")
        self.nodes = [node for node, _, _ in where]
        self.names = [f"worker rank {rank} (pid {pid}, node {ip})"
                      for rank, (_, ip, pid) in enumerate(where)]
        places = local_ranks(self.nodes)
        if cpu:  # ranks on one node share its memory
            self.memory_sharers = [size for _, size in places]
        init_method = config.parallel.replica_init_method
        if init_method is None:
            port = ray.get(self.actors[0].free_port.remote(), timeout=PLACEMENT_TIMEOUT_S)
            init_method = f"tcp://{where[0][1]}:{port}"
        for rank, (local_rank, local_size) in enumerate(places):
            spec = wire.WorkerSpec(
                rank, self.tp_size, self.pp_size, local_rank, local_size, init_method,
                logging.getLogger().getEffectiveLevel(), config, source, arch, max_model_len,
                list(eos_token_ids))
            self.pending[self.actors[rank].start.remote(wire.encoder.encode(spec))] = rank
        self._gather(wire.READY_CALL_ID, "start-up (loading the model)")

    def describe(self) -> str:
        return (f"{super().describe()}, {self.world_size} Ray actors on {len(set(self.nodes))} "
                f"node(s) "
                f"({self.layout})")

    def check_health(self) -> None:
        super().check_health()
        self._broadcast(wire.CheckHealth(self._next_id()), "check_health",
                        timeout_s=HEALTH_TIMEOUT_S)

    # --- the transport ------------------------------------------------------------------------

    def _post(self, rank: int, payload: bytes) -> None:
        self.pending[self.actors[rank].call.remote(payload)] = rank

    def _receive(self, timeout_s: float) -> list[bytes]:
        if not self.pending:  # every call answered or failed: the caller looks at the ranks
            time.sleep(timeout_s)
            return []
        ready, _ = self.ray.wait(list(self.pending), num_returns=1, timeout=timeout_s)
        replies = []
        for ref in ready:
            rank = self.pending.pop(ref)
            try:
                replies.append(self.ray.get(ref))
            except self.ray.exceptions.RayError as exc:
                self.deaths.setdefault(rank, why(exc))
        return replies

    def _rank_name(self, rank: int) -> str:
        return self.names[rank]

    def _death(self, rank: int) -> str | None:
        return self.deaths.get(rank)

    def _kill_workers(self) -> None:
        self.pending.clear()
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception as exc:  # noqa: BLE001 - gone already, or the cluster is
                logger.debug("ray.kill: %s", exc)
        # A call to a killed actor fails once it is dead: wait (boundedly) until they all are.
        probes = []
        for actor in self.actors:
            try:
                probes.append(actor.where.remote())
            except Exception:  # noqa: BLE001 - the cluster is gone
                pass
        if probes:
            self.ray.wait(probes, num_returns=len(probes), timeout=SHUTDOWN_GRACE_S)

    def _stop(self) -> None:
        ray = self.ray
        if self.pending:  # the shutdown call's replies: each rank has left its groups
            ray.wait(list(self.pending), num_returns=len(self.pending), timeout=SHUTDOWN_GRACE_S)
        self._kill_workers()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self.placement_group)
            except Exception as exc:  # noqa: BLE001 - the cluster is gone
                logger.debug("remove_placement_group: %s", exc)
            self.placement_group = None
        if self.started_ray:
            ray.shutdown()
