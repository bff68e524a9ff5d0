"""Where a worker's batches come from: arrays in the object store, the user's Dataset, or a Ray Data stream.

Every source is fed the chunk's steps (``feed``), then hands out their batches in order (``next``);
``drop`` forgets what was fed but not taken (a step abandoned in a restart).  A batch is
``(inputs, targets)``, inputs a tensor, a tuple or a dict of tensors.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np
import ray
import torch

from raympi.core import pytree
from raympi.exceptions import TrainingError
from raympi.worker.loader import Loader, read_batch

__all__ = ["ArraySource", "DatasetSource", "StreamSource", "arrays_from_refs"]


def arrays_from_refs(refs: Any) -> Any:
    """A tree of tensors from a tree of object refs of arrays (zero-copy, read-only: only gathered from)."""
    leaves, spec = pytree.flatten(refs)
    values = ray.get(leaves)
    return pytree.unflatten(
        [v if isinstance(v, torch.Tensor) else pytree.from_arrays(np.asarray(v)) for v in values], spec
    )


class ArraySource:
    """The in-memory fast path: ``(inputs, targets)`` tensors, gathered by index."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.queue: collections.deque[torch.Tensor] = collections.deque()

    def feed(self, steps: Sequence[tuple[int, Any]]) -> None:
        self.queue.extend(index for _, index in steps)

    def next(self) -> Any:
        return self.read(self.queue.popleft())

    def read(
        self, index: Any, epoch: int = -1
    ) -> Any:  # sample indices: numpy from the driver, a tensor for evaluation
        return pytree.map(lambda t: t[index], self.data)

    def drop(self) -> None:
        self.queue.clear()

    def close(self) -> None:
        pass


class DatasetSource:
    """A map-style Dataset read by a :class:`~raympi.worker.loader.Loader` (seeded per sample, prefetched)."""

    def __init__(self, dataset: Any, seed: int, loader_workers: int) -> None:
        self.dataset, self.seed = dataset, seed
        self.loader = Loader(dataset, seed, loader_workers)

    def feed(self, steps: Sequence[tuple[int, Any]]) -> None:
        self.loader.feed(steps)

    def next(self) -> Any:
        return self.loader.next()

    def read(
        self, index: Any, epoch: int = -1
    ) -> Any:  # sample indices: numpy from the driver, a tensor for evaluation
        """Read in this thread (evaluation: no augmentation is expected, but it is seeded all the same)."""
        return read_batch(self.dataset, self.seed, epoch, index.tolist())

    def drop(self) -> None:
        self.loader.drop()

    def close(self) -> None:
        self.loader.close()


class StreamSource:
    """This rank's part of a ``ray.data.Dataset`` (``streaming_split``), read as a stream, epoch by epoch.

    A step is ``(epoch, (position in the epoch, local batch size))``.  A step that does not follow
    the last one read (a restart, a resume) starts the epoch's stream afresh and skips to it.
    """

    def __init__(self, iterator: Any, columns: tuple[str, str]) -> None:
        self.iterator, self.columns = iterator, columns
        self.queue: collections.deque[tuple[int, tuple[int, int]]] = collections.deque()
        self.batches: Any = None
        self.at: tuple[int, int] | None = None  # (epoch, position) of the next batch the stream gives

    def feed(self, steps: Sequence[tuple[int, Any]]) -> None:
        self.queue.extend(steps)

    def next(self) -> Any:
        epoch, (position, size) = self.queue.popleft()
        if self.at != (epoch, position):
            self.batches = iter(self.iterator.iter_torch_batches(batch_size=size, drop_last=True))
            for _ in range(position):
                next(self.batches)
        try:
            batch = next(self.batches)
        except StopIteration:
            raise TrainingError(f"the Ray Dataset stream ran out at step {position + 1} of epoch {epoch}") from None
        self.at = (epoch, position + 1)
        return batch[self.columns[0]], batch[self.columns[1]]

    def read(
        self, index: Any, epoch: int = -1
    ) -> Any:  # sample indices: numpy from the driver, a tensor for evaluation
        raise TrainingError("a Ray Dataset cannot be read by index")

    def drop(self) -> None:
        self.queue.clear()
        self.at = None

    def close(self) -> None:
        pass
