"""Worker processes kept between ``fit`` calls of one driver (``keep_workers=True``).

A run that ends well parks its workers, their placement group and their hot spares here instead of
killing them; the next ``fit`` of the same shape (workers, resources per worker, placement strategy,
the workers' environment) in the same Ray job takes them: no new process, no second import of torch,
only the new model and data.  Any other ``fit`` releases them first, so parked workers never hold
resources a run needs.  Ray ends them with the job.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

__all__ = ["Parked", "end", "job", "park", "release", "release_workers", "take"]

log = logging.getLogger("raympi")


@dataclasses.dataclass
class Parked:
    """A finished run's workers: ``actors[i]`` in bundle ``i`` of ``pg``; ``spares`` outside it."""

    key: tuple[Any, ...]
    job: str
    pg: Any
    actors: list[Any]
    spares: list[Any]


_parked: list[Parked] = []


def job() -> str:
    """This driver's Ray job, on this Ray instance (a new local instance counts its jobs from 1 again)."""
    context = ray.get_runtime_context()
    return f"{context.get_job_id()}@{context.get_node_id()}"


def park(entry: Parked) -> None:
    """Keep ``entry`` for the next ``fit`` of its shape (one entry at a time: an older one is released)."""
    release()
    _parked.append(entry)
    log.info("raympi: %d worker(s) and %d spare(s) kept for the next fit", len(entry.actors), len(entry.spares))


def take(key: tuple[Any, ...]) -> Parked | None:
    """The parked workers of shape ``key`` in this Ray job, or ``None``; every other entry is released."""
    here = job() if ray.is_initialized() else ""
    found = next((p for p in _parked if p.key == key and p.job == here), None)
    if found is not None:
        _parked.remove(found)
    release()
    return found


def release() -> None:
    """Kill every parked worker and remove its placement group."""
    while _parked:
        end(_parked.pop())


def end(entry: Parked) -> None:
    """Kill ``entry``'s workers and remove its placement group (those of an ended Ray job are gone already)."""
    if ray.is_initialized() and entry.job == job():
        for actor in entry.actors + entry.spares:
            ray.kill(actor, no_restart=True)
        remove_placement_group(entry.pg)


def release_workers() -> None:
    """End the worker processes a ``fit(..., keep_workers=True)`` kept, now (``ray.shutdown()`` ends them too)."""
    release()
