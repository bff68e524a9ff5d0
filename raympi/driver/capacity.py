"""What the cluster can host: the resources of one worker, and how many fit on the live nodes."""

from __future__ import annotations

import math
from typing import Any, Container, Sequence

import ray

from raympi.driver import tune
from raympi.driver.config import FitConfig
from raympi.driver.drains import draining_nodes

__all__ = ["cluster_capacity", "spans_hosts", "worker_bundle"]


def worker_bundle(cfg: FitConfig, use_gpu: bool) -> dict[str, float]:
    """The resources one worker holds: with GPUs, one GPU unless ``resources_per_worker`` names a
    share (``{"GPU": 0.5}``: two workers on one GPU)."""
    bundle = dict(cfg.resources_per_worker)
    if use_gpu:
        bundle["GPU"] = bundle.get("GPU") or 1.0
    return bundle


def _room(node: dict[str, Any], bundle: dict[str, float], draining: Container[str] = ()) -> int:
    """How many bundles of ``bundle`` a live node's total resources hold (0 for a dead or ``draining`` node)."""
    if not node.get("Alive") or node["NodeID"] in draining:
        return 0
    res = node.get("Resources", {})
    return min((math.floor(res.get(k, 0) / v + 1e-9) for k, v in bundle.items() if v > 0), default=0)


def cluster_capacity(bundle: dict[str, float]) -> int:
    """How many bundles of ``bundle`` the live nodes could host, counting their total resources, a draining
    node's never (inside a Tune trial: the bundles it reserved for the workers)."""
    slots = tune.current()
    if slots is not None:
        return len(slots.bundles)
    draining = draining_nodes()
    return sum(_room(node, bundle, draining) for node in ray.nodes())


def spans_hosts(bundle: dict[str, float], placed: Sequence[str]) -> bool:
    """Whether a group may span hosts: its placed nodes or any live node that could host one more worker.

    Replacements started later (warm restart, growing back) inherit the group's MPI environment
    and may land on another host than the original ranks, so the choice counts every live node
    that could host a worker, not only where the ranks are now.
    """
    ips = {
        node.get("NodeManagerAddress")
        for node in ray.nodes()
        if node.get("Alive") and (node["NodeID"] in placed or _room(node, bundle) >= 1)
    }
    return len(ips) > 1
