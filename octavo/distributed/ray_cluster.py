"""Joining a Ray cluster, for the ray executor's rank actors and for data-parallel replicas on
Ray (`--data-parallel-backend ray`) alike.

octavo joins the cluster this process is connected to, else the one `RAY_ADDRESS` names or a
`ray start` on this machine started, else starts a local one (and its user stops it at
shutdown). So a model runs across machines with `ray start --head` on one and
`ray start --address=HEAD:6379` on the others, then octavo on the head.
"""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

__all__ = ["connect", "import_ray", "where", "why"]


def import_ray():
    try:
        import ray
    except ImportError as exc:
        raise ImportError("the ray backend needs Ray, an optional extra: pip install "
                          "'octavo[ray]' (or use mp: local processes)") from exc
    return ray


def connect(ray) -> bool:
    """Connect to the Ray cluster there is, else start a local one; whether it was started."""
    if ray.is_initialized():
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address="auto")  # the cluster RAY_ADDRESS names: an error if it is not there
        return False
    try:
        ray.init(address="auto")  # a `ray start` on this machine
        return False
    except ConnectionError:
        pass
    ray.init(include_dashboard=False)
    logger.info("started a local Ray instance (%s)", ray.cluster_resources())
    return True


def where() -> tuple[str, str, int]:
    """(Ray node id, node IP address, pid) of the calling actor."""
    import ray

    return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
            os.getpid())


def why(exc: BaseException) -> str:
    """A Ray error on one line (its text spans many)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:400]}"
