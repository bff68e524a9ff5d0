"""Nodes being drained: a spot node's preemption notice or an operator's ``ray drain-node``.

Ray's GCS knows which nodes are draining and until when, but Ray has no public call for it: this module is
the one place raympi reaches into Ray's private API for it (``tests/test_drains.py`` fails loudly when a Ray
release moves these calls).  The driver polls :func:`draining_nodes` between chunks and moves the ranks on a
draining node to hot spares elsewhere before its deadline (see :mod:`raympi.driver.controller`).
"""

from __future__ import annotations

import logging
import time

import ray

__all__ = ["drain_node", "draining_nodes"]

log = logging.getLogger("raympi")
_warned = False  # said once a process that Ray could not say which nodes are draining


def draining_nodes() -> dict[str, float | None]:
    """The nodes being drained: node id (hex) -> the deadline (Unix seconds), ``None`` where there is none.

    ``{}`` when Ray cannot say (a release without the call: one warning, and the run goes on without notices)."""
    global _warned
    try:
        deadlines: dict[str, int] = ray._private.state.state.get_draining_nodes()
    except Exception as exc:  # Ray's private API: never worth stopping a run over
        if not _warned:
            _warned = True
            log.warning("raympi: Ray could not say which nodes are being drained (%s): drains go unnoticed", exc)
        return {}
    return {node: (ms / 1000 if ms else None) for node, ms in deadlines.items()}


def drain_node(node_id: str, message: str, deadline_s: float | None = None, address: str | None = None) -> None:
    """Ask Ray to drain ``node_id`` for a preemption, as ``ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION``
    does (a spot-notice handler's call): no new work goes to the node, which is expected gone within
    ``deadline_s`` seconds (``None``: no deadline).  The node keeps running until someone removes it.

    Raises:
        RuntimeError: Ray refused the request (its reason in the message).
    """
    from ray.core.generated import autoscaler_pb2

    gcs = ray._raylet.GcsClient(address=address or ray.get_runtime_context().gcs_address)  # type: ignore[attr-defined]
    deadline_ms = 0 if deadline_s is None else int(1000 * (time.time() + deadline_s))
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
    accepted, why = gcs.drain_node(node_id, reason, message, deadline_ms)
    if not accepted:
        raise RuntimeError(f"Ray did not accept draining node {node_id}: {why}")
