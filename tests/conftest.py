"""Shared fixtures: one private local Ray instance for the whole test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="module")
def ray_session():
    """A private local Ray instance (never a stale cluster recorded on the machine)."""
    import ray

    ray.init(
        address="local",
        num_cpus=8,
        include_dashboard=False,
        logging_level="ERROR",
        runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}},
    )
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def spawn(ray_session):
    """``spawn(actor_class, n)``: ``n`` ready actors, killed when the module's tests are done."""
    made = []

    def start(actor_class, n: int) -> list:
        actors = [actor_class.remote() for _ in range(n)]
        ray_session.get([a.__ray_ready__.remote() for a in actors])
        made.extend(actors)
        return actors

    yield start
    for actor in made:
        ray_session.kill(actor)
