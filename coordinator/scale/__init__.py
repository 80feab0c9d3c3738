"""Scale-out on a Ray cluster (docs/scale-out.md): a sweep's runs as Ray tasks (ray_sweep.py), and one run's
round trained by Ray actors on several nodes (ray_engine.py).

Ray is an optional extra (`pip install 'dropfl[ray]'`): nothing here imports it at module level, so the
rest of dropfl works without it, and asking for Ray without it is one line saying how to install it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Iterator

from coordinator.errors import UserError

log = logging.getLogger("dropfl.scale")

INSTALL = "pip install 'dropfl[ray]'"


def require_ray(what: str = "--ray"):
    """The `ray` module, or UserError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError(f"{what} needs Ray, which is not installed; install the extra with `{INSTALL}` "
                        f"(on every node of the cluster)") from None
    return ray


@contextlib.contextmanager
def connected(address: str | None, what: str = "--ray") -> Iterator[object]:
    """Ray connected to the cluster at `address` for the block; the `ray` module.

    `address`: "host:port" of a running cluster's head (`ray start --head` prints it), None = $RAY_ADDRESS
    (`dropfl reproduce --ray ADDRESS` sets it), "auto" (also for None without $RAY_ADDRESS) = the cluster
    RAY_ADDRESS names or the one started on this machine (an error if there is none), "local" = a
    private single-node Ray for this command only. If this process is already connected (tests, notebooks),
    that connection is used and left open; one this function opened is closed at the end of the block."""
    ray = require_ray(what)
    if ray.is_initialized():
        yield ray
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    _check_reachable(target, what)
    try:
        # workers' stdout/stderr stay in the cluster's logs (/tmp/ray/session_*/logs): every run's progress
        # lines would otherwise interleave here; progress is reported by the driver
        ray.init(address=target, log_to_driver=False, include_dashboard=False if target == "local" else None,
                 configure_logging=False)
    except (ConnectionError, ValueError, RuntimeError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{what} {target}: cannot connect to a Ray cluster there ({first}); start one with "
                        f"`ray start --head` (docs/scale-out.md) and give its address, or use `local`") from None
    try:
        yield ray
    finally:
        ray.shutdown()


def check_cluster(address: str | None, what: str = "--ray") -> None:
    """UserError now, before anything is written, if Ray is missing or there is no cluster at `address`
    (one connection, closed again; a "local" Ray is only started when it is used)."""
    if (address or os.environ.get("RAY_ADDRESS")) == "local":
        require_ray(what)
        return
    with connected(address, what):
        pass


def _check_reachable(target: str, what: str, timeout: float = 5.0) -> None:
    """For a host:port address, that something listens there: `ray.init` retries an address where nothing
    listens for minutes (measured: over 3 minutes), this answers in `timeout` seconds."""
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or "://" in target:
        return   # auto, local, ray:// client addresses: Ray's own checks
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise UserError(f"{what} {target}: nothing answers there ({e.strerror or e}); start the cluster's head "
                        f"with `ray start --head --port {port}` (docs/scale-out.md) or give its address") from None


def cluster_cpus(ray) -> int:
    """CPUs of the connected cluster (at least 1)."""
    return max(1, int(ray.cluster_resources().get("CPU", 1)))
