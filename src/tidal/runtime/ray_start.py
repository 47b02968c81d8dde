"""The Ray a run starts (one machine, on loopback) or joins (``--address``), and SIGTERM as
an interrupt around it.

In: the ``ray`` module and the run's Ray settings. Out: Ray initialised with the run's SIGTERM
handler kept (``trap_sigterm``: SIGTERM ends the run like Ctrl-C, so every part it started is
stopped), and the ids of the nodes alive (``alive_nodes``: the driver's count of nodes lost).
Moved whole out of ``driver`` (its setup of Ray, before any part of the run starts).
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path
from typing import Any


def interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def trap_sigterm() -> Any:
    """Turn SIGTERM into KeyboardInterrupt (main thread only); returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, interrupt)


def ray_init(ray: Any, **kwargs: object) -> None:
    """``ray.init`` keeping this run's SIGTERM handler: Ray's init installs one that calls
    ``sys.exit(15)`` wherever the signal lands, so a SIGTERM while Ray starts ended the run
    with no line and exit code 0 (seen once in CI) instead of stopping its parts (130). Ray's
    ``_private.utils.set_sigterm_handler`` is held inert for the call."""
    utils = getattr(getattr(ray, "_private", None), "utils", None)
    install = getattr(utils, "set_sigterm_handler", None)
    if install is None:  # another Ray layout: its handler, then ours again right after
        ray.init(**kwargs)
        return
    utils.set_sigterm_handler = lambda handler: None
    try:
        ray.init(**kwargs)
    finally:
        utils.set_sigterm_handler = install


def init_loopback_ray(
    ray: Any,
    num_cpus: int,
    num_gpus: int | None,
    object_store_bytes: int,
    temp_dir: Path | None = None,
) -> None:
    """A one-machine Ray whose every process (GCS, raylet, workers, this driver) listens on
    loopback only, without a dashboard. Ray turns ``_node_ip_address="127.0.0.1"`` into the
    host's address unless it believes clusters are off (its Windows/macOS default), so that
    belief is held for the start (the raylet and workers get 127.0.0.1 on their command line)
    and given back after it: a later ``--address`` run resolves node addresses as usual.
    ``temp_dir``: Ray's session folder's parent (``runtime.ray_temp``; None: Ray's default)."""
    from ray._private import ray_constants

    key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
    env, flag = os.environ.get(key), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[key], ray_constants.ENABLE_RAY_CLUSTER = "0", False
    try:
        ray_init(
            ray,
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            object_store_memory=object_store_bytes,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
            **({"_temp_dir": str(temp_dir)} if temp_dir is not None else {}),
            # no idle Python workers started ahead of need: every worker this run uses
            # hosts a named actor, started on its creation (3 idle ones held ~240 MB)
            _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        )
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = flag
        if env is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = env


def alive_nodes(ray: Any) -> set[str]:
    """The ids of the Ray nodes alive now (``nodes_lost``: those of the start gone since)."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}
