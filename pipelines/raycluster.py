"""Connecting to Ray: a cluster when RAY_ADDRESS is set (as under `ray job submit`), else a
local Ray sized for this machine. Fails fast, with the address in the message."""
from __future__ import annotations

import os
import socket
from urllib.parse import urlparse


class RayUnavailable(RuntimeError):
    pass


def check_address(address: str, timeout: float = 5.0) -> None:
    """A TCP connect to the GCS first: ray.init retries an unreachable address for minutes."""
    if address == "auto":
        return
    parsed = urlparse(address if "://" in address else f"tcp://{address}")
    if not parsed.hostname or not parsed.port:
        raise RayUnavailable(f"RAY_ADDRESS={address!r} is not host:port")
    try:
        socket.create_connection((parsed.hostname, parsed.port), timeout=timeout).close()
    except OSError as e:
        raise RayUnavailable(f"cannot reach Ray at RAY_ADDRESS={address!r}: {e}") from e


def init_ray(num_cpus: int | None = None, object_store_mb: int = 512) -> dict:
    """Start or join Ray; returns the cluster's resources."""
    import ray

    if ray.is_initialized():
        return ray.cluster_resources()
    address = os.environ.get("RAY_ADDRESS")
    if address:
        check_address(address)
    try:
        if address:
            ray.init(address=address, log_to_driver=True)
        else:
            # "local": a Ray of its own, never one another program started on this machine,
            # which ray.init() alone would join.
            ray.init(address="local", num_cpus=num_cpus, object_store_memory=object_store_mb << 20, include_dashboard=False,
                     log_to_driver=True)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise RayUnavailable(f"cannot reach Ray at RAY_ADDRESS={address!r}: {str(e).splitlines()[0]}") from e
    return ray.cluster_resources()
