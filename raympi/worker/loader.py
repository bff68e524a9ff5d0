"""Layer 3: reading the user's map-style Dataset on a worker, by the sample indices the driver sends.

Sample ``i`` of epoch ``e`` is read right after Python's, numpy's and torch's generators are seeded
from ``(seed, e, i)``: a random augmentation is drawn afresh every epoch, and identically on any
rank, with any world size and after any restart or resize.  Batches are collated with torch's
default rules (tuples, dicts and several inputs work).

With ``loader_workers=k > 0`` reads run in ``k`` processes forked when the worker starts (before
it joins MPI), each with generators of its own, so the training step's dropout stream is never
touched; they prefetch the next batches while the current step computes, and tensors come back
through shared memory.  With ``0`` a batch is read in the step's own thread just before the step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import multiprocessing
import random
import signal
import traceback
from typing import Any, Sequence

import numpy as np
import torch
from torch.utils.data import default_collate

from raympi.exceptions import TrainingError

__all__ = ["Loader", "read_batch", "sample_seed"]

_MASK64 = (1 << 64) - 1
_PR_SET_PDEATHSIG = 1
_DATASET: Any = None  # the dataset of this loader process (set once, when the pool forks)


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A well-spread 64-bit seed for reading sample ``index`` in ``epoch`` (splitmix64 of the three)."""
    x = (seed * 0x9E3779B97F4A7C15 + (epoch + 1) * 0xBF58476D1CE4E5B9 + (index + 1) * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed & 0xFFFFFFFF)
    # The CPU generator only: torch.manual_seed also seeds every accelerator's (90 us a call here,
    # 100x this), and a Dataset's transforms draw on the CPU.
    torch.default_generator.manual_seed(seed)


def read_batch(dataset: Any, seed: int, epoch: int, indices: Sequence[int]) -> Any:
    """Read and collate ``dataset[i]`` for each ``i``, each under its own ``(seed, epoch, i)`` seed.

    Raises:
        TrainingError: an item raised (the message names the sample and carries its traceback), or
            the items do not collate (the message shows the first two that differ).
    """
    items = []
    for i in indices:
        _seed_all(sample_seed(seed, epoch, int(i)))
        try:
            items.append(dataset[int(i)])
        except Exception as exc:
            raise TrainingError(
                f"reading sample {int(i)} (epoch {epoch}) raised {type(exc).__name__}: {exc}\n\n"
                f"Traceback of the read:\n{traceback.format_exc()}"
            ) from None
    try:
        return default_collate(items)
    except Exception as exc:
        first, other = _first_mismatch(items, indices)
        raise TrainingError(
            f"samples of a batch do not fit together ({type(exc).__name__}: {exc}): "
            f"sample {first[0]} is {first[1]}, sample {other[0]} is {other[1]}"
        ) from None


def _describe(item: Any) -> str:
    if isinstance(item, torch.Tensor):
        return f"tensor{tuple(item.shape)} {item.dtype}"
    if isinstance(item, np.ndarray):
        return f"array{item.shape} {item.dtype}"
    if isinstance(item, (tuple, list)):
        return "(" + ", ".join(_describe(x) for x in item) + ")"
    if isinstance(item, dict):
        return "{" + ", ".join(f"{k!r}: {_describe(v)}" for k, v in item.items()) + "}"
    return type(item).__name__


def _first_mismatch(items: list[Any], indices: Sequence[int]) -> tuple[tuple[int, str], tuple[int, str]]:
    base = _describe(items[0])
    for item, i in zip(items, indices):
        if _describe(item) != base:
            return (int(indices[0]), base), (int(i), _describe(item))
    return (int(indices[0]), base), (int(indices[-1]), _describe(items[-1]))


def _init_process(torch_threads: int) -> None:
    torch.set_num_threads(torch_threads)
    try:  # die with the worker (Ray kills actors with SIGKILL: no chance to shut the pool down)
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass


def _read_in_process(seed: int, epoch: int, indices: list[int]) -> Any:
    return read_batch(_DATASET, seed, epoch, indices)


def _noop() -> None:
    return None


class Loader:
    """Reads batches of one dataset in order, ``ahead`` batches in advance.

    Args:
        dataset: a map-style dataset (``__getitem__`` and ``__len__``).
        seed: the run's seed.
        workers: loader processes (0: read in the caller's thread).
        ahead: batches read in advance (with ``workers > 0``).
    """

    def __init__(self, dataset: Any, seed: int, workers: int = 1, ahead: int = 4) -> None:
        global _DATASET
        self.dataset, self.seed, self.ahead = dataset, seed, max(1, ahead)
        self.pool: concurrent.futures.ProcessPoolExecutor | None = None
        self.queue: collections.deque[list[Any]] = collections.deque()  # [epoch, indices, future or None]
        if workers > 0:
            _DATASET = dataset  # the forked processes inherit it: no pickling, shared copy-on-write
            self.pool = concurrent.futures.ProcessPoolExecutor(
                workers, mp_context=multiprocessing.get_context("fork"), initializer=_init_process, initargs=(1,)
            )
            concurrent.futures.wait([self.pool.submit(_noop) for _ in range(workers)])  # fork now, before MPI starts

    def feed(self, batches: Sequence[tuple[int, Sequence[int]]]) -> None:
        """Queue batches to read, as ``(epoch, indices)`` in the order :meth:`next` will return them."""
        self.queue.extend([epoch, [int(i) for i in indices], None] for epoch, indices in batches)
        self._top_up()

    def next(self) -> Any:
        """The next batch (collated), in the order fed."""
        epoch, indices, future = self.queue.popleft()
        self._top_up()
        return future.result() if future is not None else read_batch(self.dataset, self.seed, epoch, indices)

    def drop(self) -> None:
        """Forget the batches still queued (a chunk ended early)."""
        for entry in self.queue:
            if entry[2] is not None:
                entry[2].cancel()
        self.queue.clear()

    def _top_up(self) -> None:
        if self.pool is None:
            return
        for entry in list(self.queue)[: self.ahead]:
            if entry[2] is None:
                entry[2] = self.pool.submit(_read_in_process, self.seed, entry[0], entry[1])

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)
            self.pool = None
