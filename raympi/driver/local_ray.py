"""The private local Ray instance ``fit`` starts when it is given no cluster.

It is ``ray.init(address="local")``'s instance, with one thing moved off the path to the first step:
Ray's log monitor (it forwards the workers' output to the driver) starts once the driver is connected,
not before the raylet. Started first, it competes for the cores with the raylet and its agents, whose
registration ``ray.init`` polls once a second: measured 0.8 s off Ray's start inside ``fit`` on 2 cores
(benchmarks/RESULTS.md). That takes Ray's ``Node``, which ``ray.cluster_utils`` uses too; where a Ray release has
none, this is plain ``ray.init``.
"""

from __future__ import annotations

import logging

from typing import Callable

import ray

__all__ = ["start"]


def start() -> Callable[[], None]:
    """Start a local Ray head, connect this driver to it, and return what stops both."""
    try:
        from ray._private.node import Node
        from ray._private.parameter import RayParams
    except ImportError:
        ray.init(address="local", include_dashboard=False, logging_level=logging.ERROR)
        return ray.shutdown
    # As ray.init starts it (its own stop is ours: no SIGTERM handler of Ray's over fit's); the reaper
    # ends Ray's processes if this driver dies.
    # No dashboard, and no fixed port for its agent (Ray's 52365): another driver or test run beside this one
    # would fight over it.
    params = RayParams(
        include_dashboard=False,
        include_log_monitor=False,  # type: ignore[arg-type]  # (a bool, as Ray reads it)
        dashboard_port=None,
        dashboard_agent_listen_port=0,
    )
    node = Node(
        params,
        head=True,
        shutdown_at_exit=False,
        spawn_reaper=True,
        ray_init_cluster=True,
    )

    def stop() -> None:
        ray.shutdown()
        node.destroy_external_storage()
        node.kill_all_processes(check_alive=False, allow_graceful=True)

    try:
        ray.init(address=node.address, logging_level=logging.ERROR)
        node.start_log_monitor()
    except BaseException:
        stop()
        raise
    return stop
