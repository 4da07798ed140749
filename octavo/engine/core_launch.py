"""Start the engine core's process as early as a start allows.

The core's start is mostly `import torch` (about 1 s here) and the weights; the front end's
(its web stack, the tokenizer) runs beside it on another core. So `octavo serve` launches the
core right after parsing its arguments, before it imports the front end's own modules (0.15 s),
and this module imports only the standard library and `octavo.config`: the child imports the
core's code itself. The front end hands the model's setup over later, through `setup`.
"""
from __future__ import annotations

import logging
import multiprocessing
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

from octavo.config import EngineConfig
from octavo.distributed.lockstep import free_port


@dataclass
class CoreLaunch:
    """A started core process and the ends the front end keeps: `ready` (the core's one
    ("ready" | "error", info) message), `setup` (the front end sends the model's setup, or closes
    it unsent to make the core quit) and the ZeroMQ addresses the front end binds (where one
    names a wildcard port, the front end writes the bound address back before the setup)."""
    process: BaseProcess
    ready: Connection
    setup: Connection
    input_addr: str
    output_addr: str
    ipc_dir: str
    started: float

    def abandon(self) -> None:
        """The front end failed before handing the setup over: stop the core (it has only been
        importing) and remove the socket folder."""
        self.setup.close()
        self.process.kill()
        self.process.join(5)
        self.release()

    def release(self) -> None:
        """What the launch holds beyond the process, once the sockets are closed."""
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


def launch_cores(config: EngineConfig) -> list:
    """One core per data-parallel replica: local processes (CoreLaunch), or Ray actors with the
    same surface (core_launch_ray.py, `data_parallel_backend` ray)."""
    replicas = config.parallel.data_parallel_size
    if config.parallel.data_parallel_backend == "ray":
        from octavo.engine.core_launch_ray import launch_ray_cores

        return launch_ray_cores(config)
    ports = (free_port(), free_port()) if config.parallel.experts_span_replicas else (0, 0)
    return [launch_core(config, i, replicas)
            for i, config in enumerate(replica_configs(config, "127.0.0.1", *ports))]


def replica_configs(config: EngineConfig, host: str, master_port: int,
                    rpc_port: int) -> list[EngineConfig]:
    """Each replica's config: its index, and where the replicas meet where their experts span
    them (host: replica 0's; master_port: their ranks' world, rpc_port: their cores' lockstep
    group)."""
    return [config.replace(data_parallel_rank=i, data_parallel_master_ip=host,
                           data_parallel_master_port=master_port, data_parallel_rpc_port=rpc_port)
            for i in range(config.parallel.data_parallel_size)]


def launch_core(config: EngineConfig, replica: int = 0, replicas: int = 1) -> CoreLaunch:
    """Core `replica` of `replicas` (data parallelism: each pinned to its share of the cores
    with cpu_binding auto)."""
    ipc_dir = tempfile.mkdtemp(prefix="octavo-")
    input_addr, output_addr = f"ipc://{ipc_dir}/in", f"ipc://{ipc_dir}/out"
    mp = multiprocessing.get_context(_start_method())
    ready, ready_child = mp.Pipe(duplex=False)
    setup_child, setup = mp.Pipe(duplex=False)
    started = time.perf_counter()
    process = mp.Process(
        target=_core_main, name="octavo-engine-core", daemon=True,
        args=(config, setup_child, input_addr, output_addr, ready_child,
              logging.getLogger().getEffectiveLevel(), replica, replicas))
    process.start()
    ready_child.close()
    setup_child.close()
    return CoreLaunch(process, ready, setup, input_addr, output_addr, ipc_dir, started)


def _start_method() -> str:
    """fork where nothing makes it unsafe: on Linux, with no other thread (a forked child inherits
    the locks other threads held) and no torch yet (its OpenMP pool does not survive a fork),
    which is how `octavo serve` calls this. The child then needs no interpreter of its own, no
    second import of octavo's entry modules and no resource-tracker process (spawn starts one):
    0.1 s of a 2-core start. Anywhere else, spawn."""
    if (sys.platform == "linux" and threading.active_count() == 1
            and "torch" not in sys.modules):
        return "fork"
    return "spawn"


def _core_main(*args) -> None:
    """The child's entry: the core's modules load here, not in the front end."""
    from octavo import startup_gc

    startup_gc.pause()
    from octavo.engine.core_process import run_engine_core

    run_engine_core(*args)
