"""Data-parallel replicas on Ray (`--data-parallel-backend ray`): each replica's engine core is
a Ray actor (core_process.RayEngineCore), placed by Ray on any machine of the cluster, speaking
to the front end over TCP instead of a local socket. Each launch offers CoreLaunch's surface
(`process`, `ready`, `setup`, the addresses), so the front ends hold a replica on Ray exactly as
a local one: `process` is the actor (alive while its loop runs), `ready` its start call.

The cluster is joined as distributed/ray_cluster.py says; a local instance started here is
stopped when the last replica is released.
"""
from __future__ import annotations

import logging
import time

from octavo.config import EngineConfig
from octavo.distributed.placement import local_ranks
from octavo.distributed.ray_cluster import connect, import_ray, why
from octavo.engine.core_launch import replica_configs
from octavo.engine.core_process import RayEngineCore

logger = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # for the cluster to find each replica's CPUs and start its actor


def launch_ray_cores(config: EngineConfig) -> list[RayCoreLaunch]:
    ray = import_ray()
    replicas = config.parallel.data_parallel_size
    cluster = _Cluster(ray, connect(ray), replicas)
    started = time.perf_counter()
    if config.device.device == "cpu":
        cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // replicas)
        resources = {"num_cpus": cpus}
    else:
        resources = {"num_cpus": 0, "num_gpus": config.parallel.world_size}
    actor_class = ray.remote(RayEngineCore)
    actors = [actor_class.options(max_restarts=0, max_task_retries=0,
                                  scheduling_strategy="SPREAD", **resources).remote()
              for _ in range(replicas)]
    try:
        where = ray.get([actor.where.remote() for actor in actors], timeout=PLACEMENT_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as exc:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        cluster.release_all()
        raise RuntimeError(
            f"the Ray cluster cannot place {replicas} data-parallel replicas of {resources} "
            f"each within {PLACEMENT_TIMEOUT_S:g} s (it has {ray.cluster_resources()}): "
            f"{why(exc)}; add nodes with `ray start --address=...` or ask for fewer "
            f"replicas") from exc
    front_end = ray.util.get_node_ip_address()
    places = local_ranks([node for node, _, _ in where])
    ports = (ray.get([actors[0].free_port.remote() for _ in range(2)])
             if config.parallel.experts_span_replicas else (0, 0))
    configs = replica_configs(config, where[0][1], *ports)
    launches = [RayCoreLaunch(cluster, actor, replica_config, f"tcp://{front_end}:*", place, pid,
                              started)
                for actor, replica_config, place, (_, _, pid) in zip(actors, configs, places,
                                                                      where)]
    logger.info("data-parallel replicas on Ray: %s", ", ".join(
        f"{i}: node {ip} pid {pid}" for i, (_, ip, pid) in enumerate(where)))
    return launches


class _Cluster:
    """The Ray connection the replicas share: a local instance started for them stops once the
    last replica is released."""

    def __init__(self, ray, started: bool, users: int) -> None:
        self.ray, self.started, self.users = ray, started, users

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.release_all()

    def release_all(self) -> None:
        self.users = 0
        if self.started and self.ray.is_initialized():
            self.ray.shutdown()


class RayCoreLaunch:
    def __init__(self, cluster: _Cluster, actor, config: EngineConfig, address: str,
                 place: tuple[int, int], pid: int, started: float) -> None:
        self.cluster, self.config, self.place, self.started = cluster, config, place, started
        self.input_addr = self.output_addr = address  # ports bound by the front end
        self.process = _ActorProcess(cluster.ray, actor, pid)
        self.ready = _StartCall(self.process)
        self.setup = _Setup(self)
        self._released = False

    def abandon(self) -> None:
        self.release()

    def release(self) -> None:
        """The actor outlives its loop (an actor stays until killed): it goes here, and with it
        the CPUs it held in the cluster."""
        if not self._released:
            self._released = True
            self.process.kill()
            self.cluster.release()


class _ActorProcess:
    """The actor as multiprocessing's Process would show it: alive until its loop ends."""

    def __init__(self, ray, actor, pid: int) -> None:
        self.ray, self.actor, self.pid = ray, actor, pid
        self.start_ref = self.run_ref = None
        self.exitcode: int | None = None

    def is_alive(self) -> bool:
        if self.exitcode is None and self.run_ref is not None:
            done, _ = self.ray.wait([self.run_ref], timeout=0)
            if done:
                self._ended()
        return self.exitcode is None

    def _ended(self) -> None:
        try:
            self.ray.get(self.run_ref)
            self.exitcode = 0
        except self.ray.exceptions.RayError as exc:
            self.exitcode = 1
            logger.error("engine core actor (pid %d) ended: %s", self.pid, why(exc))

    def join(self, timeout: float) -> None:
        if self.run_ref is not None and self.exitcode is None:
            self.ray.wait([self.run_ref], timeout=timeout)
            self.is_alive()

    def kill(self) -> None:
        try:
            self.ray.kill(self.actor, no_restart=True)
        except Exception as exc:  # noqa: BLE001 - gone already, or the cluster is
            logger.debug("ray.kill: %s", exc)
        if self.exitcode is None:
            self.exitcode = -9


class _StartCall:
    """The ready pipe's surface over the actor's start call."""

    def __init__(self, process: _ActorProcess) -> None:
        self.process = process

    def poll(self, timeout: float) -> bool:
        if self.process.start_ref is None:
            time.sleep(timeout)
            return False
        done, _ = self.process.ray.wait([self.process.start_ref], timeout=timeout)
        return bool(done)

    def recv(self) -> tuple:
        ray = self.process.ray
        try:
            return "ready", ray.get(self.process.start_ref)
        except ray.exceptions.RayTaskError as exc:  # the core's own error, as a process's
            cause = getattr(exc, "cause", None) or exc
            return "error", (type(cause).__name__, str(cause))
        except ray.exceptions.RayError as exc:
            return "error", ("RuntimeError", why(exc))


class _Setup:
    """The setup pipe's surface: sending the model's setup starts the core, then its loop;
    closing it unsent stops the actor."""

    def __init__(self, launch: RayCoreLaunch) -> None:
        self.launch = launch

    def send(self, core_args: tuple) -> None:
        launch, process = self.launch, self.launch.process
        process.start_ref = process.actor.start.remote(
            launch.config, core_args, launch.input_addr, launch.output_addr,
            logging.getLogger().getEffectiveLevel(), *launch.place)
        process.run_ref = process.actor.run.remote()  # runs once start has returned

    def close(self) -> None:
        if self.launch.process.start_ref is None:
            self.launch.process.kill()
