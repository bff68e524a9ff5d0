"""The driver's side of the data: what kind of dataset it is, and who reads which samples when.

The driver never reads the samples: in-memory tensors go to the object store as they are, a map-style
Dataset is shipped as an object and read on the workers.

The driver owns the data order: epoch ``e`` reads the samples in the order of a
permutation seeded by ``(seed, e)``; step ``s`` of it is the global batch
``order[s * batch_size : (s + 1) * batch_size]`` (a last partial batch is
dropped, so every step has the same global batch), split over the ranks in
contiguous, possibly uneven, slices (64 over 3 ranks: 22 + 21 + 21).  The cursor
``(epoch, step)`` therefore says exactly which samples come next.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import torch

from raympi.core import pytree
from raympi.exceptions import ConfigError

# A ray.data.Dataset is streamed by Ray Data itself (``streaming_split``): the driver then sends
# each rank only its position in the epoch and its share of the global batch; the order is Ray Data's.

__all__ = ["Data", "Sampler", "columns_of", "epoch_order", "inspect", "rank_slices", "steps_per_epoch"]

_FORMS = (
    "an (inputs, targets) tuple of tensors or arrays (inputs may be a tuple or dict of them), a dict of "
    "input tensors alone (for a model that computes its own loss from labels among them), a map-style torch "
    "Dataset of (input, target) items or of dicts of inputs, or a ray.data.Dataset"
)


@dataclasses.dataclass(frozen=True)
class Data:
    """A dataset as the driver sees it, never materialized.

    Attributes:
        kind: ``"arrays"`` (in-memory tensors, the fast path) or ``"dataset"`` (a map-style Dataset,
            read on the workers).
        value: ``(inputs, targets)`` tensors (inputs a tensor, tuple or dict), a dict of input tensors
            alone, or the Dataset itself.
        length: the number of samples.
    """

    kind: str
    value: Any
    length: int


def _as_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        return torch.as_tensor(x)
    return None


def _arrays(dataset: Any) -> Any:
    """``(inputs, targets)`` (or a dict of inputs alone) as a tree of tensors when ``dataset`` is given in
    memory, else None."""
    inputs: Any
    if isinstance(dataset, dict):
        inputs = {k: _as_tensor(v) for k, v in dataset.items()}
        bad = sorted(k for k, t in inputs.items() if t is None or t.ndim == 0)
        if bad or not inputs:
            raise ConfigError(
                f"a dataset given as a dict holds the model's inputs alone, one tensor or array per keyword "
                f"with one entry per sample; {bad or 'no key'} is not"
            )
        return inputs
    if isinstance(dataset, torch.utils.data.TensorDataset) and len(dataset.tensors) == 2:
        dataset = dataset.tensors
    if not (isinstance(dataset, (tuple, list)) and len(dataset) == 2):
        return None
    inputs, targets = dataset
    targets = _as_tensor(targets)
    if isinstance(inputs, dict):
        inputs = {k: _as_tensor(v) for k, v in inputs.items()}
        leaves = list(inputs.values())
    elif isinstance(inputs, (tuple, list)):
        inputs = tuple(_as_tensor(v) for v in inputs)
        leaves = list(inputs)
    else:
        inputs = _as_tensor(inputs)
        leaves = [inputs]
    if targets is None or not leaves or any(t is None or t.ndim == 0 for t in [*leaves, targets]):
        return None
    return inputs, targets


def inspect(dataset: Any, name: str = "dataset") -> Data:
    """What kind of dataset this is and how long, without reading any item.

    Raises:
        ConfigError: an unknown kind, an empty dataset, or in-memory parts that disagree in length.
    """
    arrays = _arrays(dataset)
    if arrays is not None:
        lengths = {len(t) for t in pytree.leaves(arrays)}
        if len(lengths) > 1:
            raise ConfigError(
                f"{name}: its tensors disagree in length ({sorted(lengths)}): every input and the targets "
                "need one entry per sample"
            )
        data = Data("arrays", arrays, lengths.pop())
    elif hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"):
        data = Data("dataset", dataset, len(dataset))
    else:
        raise ConfigError(f"{name} must be {_FORMS}; got {type(dataset).__name__}")
    if data.length == 0:
        raise ConfigError(f"{name} is empty: it has no samples to train on")
    return data


def steps_per_epoch(num_samples: int, batch_size: int) -> int:
    """Full global batches in one epoch; a :class:`ConfigError` when there is not even one."""
    steps = num_samples // batch_size
    if steps == 0:
        raise ConfigError(
            f"the dataset has {num_samples} samples, fewer than batch_size={batch_size}: lower batch_size"
        )
    return steps


def epoch_order(seed: int, epoch: int, num_samples: int) -> torch.Tensor:
    """The seeded permutation of sample indices for one epoch."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def rank_slices(batch: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Split one global batch of indices into ``world_size`` contiguous, near-equal parts.

    Each part is a copy: a view would pickle the whole epoch's permutation with it (480 KB a step
    for 60,000 samples, sent to every rank).
    """
    return [part.clone() for part in torch.tensor_split(batch, world_size)]


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

    ``sharded=False``: one global permutation per epoch, each global batch split over the ranks;
    a rank gets its sample indices.  ``sharded=True`` (a Ray Data stream): a rank gets
    ``(position in the epoch, its share of the global batch)`` and reads that many rows of its stream.
    ``worlds``: the world sizes the run may have (a stream must last the epoch for each).
    """

    def __init__(self, seed: int, batch_size: int, num_samples: int, worlds: range, sharded: bool = False) -> None:
        self.seed, self.batch_size, self.num_samples, self.sharded = seed, batch_size, num_samples, sharded
        if sharded:  # the most any rank needs per step, from the rows of its stream
            self.steps_per_epoch = min(steps_per_epoch(num_samples // w, -(-batch_size // w)) for w in worlds)
        else:
            self.steps_per_epoch = steps_per_epoch(num_samples, batch_size)
        self._orders: dict[int, torch.Tensor] = {}

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            self._orders = {epoch: epoch_order(self.seed, epoch, self.num_samples)}
        return self._orders[epoch]

    def shards(self, step: int, world: int) -> list[Any]:
        """Each rank's part of global ``step``: sample indices, or (position, count) of a stream."""
        epoch, i = divmod(step, self.steps_per_epoch)
        if self.sharded:
            return [(i, len(p)) for p in rank_slices(torch.arange(self.batch_size), world)]
        return rank_slices(self._order(epoch)[i * self.batch_size : (i + 1) * self.batch_size], world)


def ship(data: Data) -> Any:
    """Put a dataset into Ray's object store once: in-memory tensors as arrays (the workers map them
    zero-copy), a Dataset as one object (pickled once, read on the workers).  Returns the ref(s)."""
    import ray

    if data.kind == "dataset":
        return ray.put(data.value)
    return pytree.map(lambda t: ray.put(t.numpy() if t.dtype != torch.bfloat16 else t), data.value)  # no numpy bfloat16
