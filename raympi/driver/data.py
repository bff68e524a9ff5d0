"""The driver's side of the data: one tensor pair per dataset, and who reads which samples when.

The driver owns the data order: epoch ``e`` reads the samples in the order of a
permutation seeded by ``(seed, e)``; step ``s`` of it is the global batch
``order[s * batch_size : (s + 1) * batch_size]`` (a last partial batch is
dropped, so every step has the same global batch), split over the ranks in
contiguous, possibly uneven, slices (64 over 3 ranks: 22 + 21 + 21).  The cursor
``(epoch, step)`` therefore says exactly which samples come next.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raympi.exceptions import ConfigError

# A ray.data.Dataset is split into equal shards per rank by Ray Data itself (``Dataset.split``);
# each rank reads its own shard in an order seeded by (seed, epoch, rank), so with Ray Data the
# data order, unlike the global-batch arithmetic, depends on the world size.

__all__ = ["Sampler", "as_tensors", "columns_of", "epoch_order", "rank_slices", "steps_per_epoch"]


def as_tensors(dataset: Any, name: str = "dataset") -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` tensors from a tuple of tensors/arrays or a map-style Dataset.

    Raises:
        ConfigError: the dataset is empty, of an unknown kind, or its parts disagree in length.
    """
    if isinstance(dataset, torch.utils.data.TensorDataset):
        dataset = dataset.tensors
    if isinstance(dataset, (tuple, list)) and len(dataset) == 2 and not isinstance(dataset[0], (tuple, list)):
        inputs, targets = (torch.as_tensor(np.asarray(x)) if not isinstance(x, torch.Tensor) else x for x in dataset)
    elif hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        if len(dataset) == 0:
            raise ConfigError(f"{name} is empty: it has no samples to train on")
        loader = torch.utils.data.DataLoader(dataset, batch_size=1024, shuffle=False)
        try:
            parts = list(loader)
        except Exception as exc:
            raise ConfigError(f"{name}: reading its items failed ({type(exc).__name__}: {exc}); items must be (input, target) pairs of tensors") from None
        if not all(isinstance(p, (tuple, list)) and len(p) == 2 for p in parts):
            raise ConfigError(f"{name}: items must be (input, target) pairs, got {type(parts[0]).__name__}")
        inputs, targets = torch.cat([p[0] for p in parts]), torch.cat([torch.as_tensor(p[1]) for p in parts])
    else:
        raise ConfigError(
            f"{name} must be a map-style torch Dataset, an (inputs, targets) tuple of tensors or arrays, "
            f"or a ray.data.Dataset; got {type(dataset).__name__}"
        )
    if len(inputs) == 0:
        raise ConfigError(f"{name} is empty: it has no samples to train on")
    if len(inputs) != len(targets):
        raise ConfigError(f"{name}: {len(inputs)} inputs but {len(targets)} targets")
    return inputs, targets


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Full global batches in one epoch; a :class:`ConfigError` when there is not even one."""
    steps = num_samples // batch_size
    if steps == 0:
        raise ConfigError(f"the dataset has {num_samples} samples, fewer than batch_size={batch_size}: lower batch_size")
    return steps


def epoch_order(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The seeded permutation of sample indices for one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def rank_slices(batch: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split one global batch of indices into ``world_size`` contiguous, near-equal parts."""
    return list(torch.tensor_split(batch, world_size))


def columns_of(dataset: Any, columns: tuple[str, str] | None) -> tuple[str, str]:
    """The (input, target) column names of a ``ray.data.Dataset``: given, or its only two columns."""
    names = list(dataset.schema().names)
    if columns is None:
        if len(names) != 2:
            raise ConfigError(f"the ray.data.Dataset has columns {names}: pass columns=(input_column, target_column)")
        return names[0], names[1]
    missing = [c for c in columns if c not in names]
    if missing:
        raise ConfigError(f"columns={tuple(columns)}: {missing} not among the dataset's columns {names}")
    return columns[0], columns[1]


class Sampler:
    """Which samples each rank reads at each step.

    ``sharded=False``: one global permutation per epoch, each global batch split over the ranks.
    ``sharded=True`` (Ray Data): each rank permutes its own equal shard and reads its part of the
    global batch from it.
    """

    def __init__(self, seed: int, batch_size: int, num_samples: int, workers: int, sharded: bool = False) -> None:
        self.seed, self.batch_size, self.num_samples, self.sharded = seed, batch_size, num_samples, sharded
        if sharded:  # the most any rank needs per step, from the smallest shard it may get
            need = -(-batch_size // workers)
            self.steps_per_epoch = steps_per_epoch(num_samples // workers, need)
        else:
            self.steps_per_epoch = steps_per_epoch(num_samples, batch_size)
        self._orders: dict[tuple[int, int, int], torch.Tensor] = {}

    def _order(self, epoch: int, rank: int, size: int) -> torch.Tensor:
        key = (epoch, rank, size)
        if key not in self._orders:
            self._orders = {k: v for k, v in self._orders.items() if k[0] == epoch}
            self._orders[key] = epoch_order(self.seed + 7919 * (rank + 1) * self.sharded, epoch, size)
        return self._orders[key]

    def shards(self, step: int, world: int) -> list[torch.Tensor]:
        """Each rank's sample indices (into the whole dataset, or into its own shard) for global ``step``."""
        epoch, i = divmod(step, self.steps_per_epoch)
        if not self.sharded:
            batch = self._order(epoch, 0, self.num_samples)[i * self.batch_size : (i + 1) * self.batch_size]
            return rank_slices(batch, world)
        sizes = [len(p) for p in rank_slices(torch.arange(self.batch_size), world)]
        shard_len = self.num_samples // world
        return [self._order(epoch, r, shard_len)[i * n : (i + 1) * n] for r, n in enumerate(sizes)]
