"""Per-step random seeding: each (run seed, step, rank) gets its own RNG stream.

``train_step`` seeds dropout and other random layers from these inside
``torch.random.fork_rng``, so a step is reproducible, ranks draw different
masks and the process's global RNG is left alone.  Part of the functional
core: torch alone.
"""

from __future__ import annotations

import torch

__all__ = ["step_seed", "seed_generators"]


def step_seed(seed: int, step: int, rank: int) -> int:
    """A well-spread 64-bit seed for one (run seed, step, rank).

    Args:
        seed: the run's seed; step: the step (from 0); rank: this rank.

    Returns:
        A seed in ``[0, 2**64)``; neighbouring steps and ranks get unrelated ones.
    """
    # splitmix64 finaliser: neighbouring steps and ranks get unrelated streams.
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB + 1) % 2**64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) % 2**64
    return x ^ (x >> 31)


def seed_generators(seed: int, cuda: list[int]) -> None:
    """Seed the CPU generator and those of the CUDA devices in use.

    Not ``torch.manual_seed``: that also queues seeds for every uninitialised
    accelerator backend, recording a stack trace each time (0.5 ms a step).

    Args:
        seed: from :func:`step_seed`.
        cuda: the indices of the CUDA devices to seed.
    """
    torch.default_generator.manual_seed(seed)
    for index in cuda:
        torch.cuda.default_generators[index].manual_seed(seed)
