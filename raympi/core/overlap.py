"""Overlapping the gradient sum with the backward pass, as DDP does: buckets reduced as they fill.

Part of the functional core (torch alone).  With ``make_train_step(overlap=True)`` the last
micro-batch's backward pass puts a hook on every parameter leaf.  The parameters are cut into
buckets in *reverse* order (the order backward produces their gradients): the first at most
:data:`FIRST_BUCKET_BYTES`, so communication starts early; the others at most
``sync.bucket_bytes``; a bucket holds one dtype on one device.  A hook copies its gradient
(plus the earlier micro-batches' sum) into its bucket's flat buffer, and hands the buffer's view
back to autograd as the gradient, so autograd's own tensor is freed at once.  A bucket whose
gradients have all arrived is handed to :meth:`BucketSync.start` at once, always in bucket
order (so every rank starts the same collectives in the same order, whatever order its hooks
fire in).  The statistics row goes last, as one more bucket, then :meth:`BucketSync.finish`.

The core knows nothing of MPI: :class:`BucketSync` is the protocol that
``raympi.comm.buckets.BucketAllreduce`` implements over a communicator.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, runtime_checkable

import torch

from raympi.core.precision import nonfinite_flag
from raympi.exceptions import TrainingError

__all__ = ["BucketSync", "Buckets", "FIRST_BUCKET_BYTES", "plan_buckets"]

#: The first bucket's size.  DDP's first bucket is small too; the last layers' gradients go out while the rest is
#: computed.
FIRST_BUCKET_BYTES = 2**20


@runtime_checkable
class BucketSync(Protocol):
    """A cross-rank sum of flat buffers, started one buffer at a time and finished together.

    ``start`` may be called from autograd's threads (a CUDA backward runs there), ``finish`` and
    ``abandon`` from the step's thread; never two at once.
    """

    bucket_bytes: int

    def start(self, bucket: torch.Tensor) -> None:
        """Begin summing ``bucket`` (a flat contiguous tensor) over the ranks, in place; return at once."""

    def finish(self) -> None:
        """Wait for every bucket started since the last ``finish``; each then holds the sum."""

    def abandon(self) -> None:
        """Give up the buckets in flight (the step failed); their memory must stay valid for MPI."""


def plan_buckets(params: dict[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Parameter names cut into buckets, in reverse order; a bucket keeps one dtype and device.

    Args:
        params: the parameters, in the model's order.
        bucket_bytes: the most bytes of a bucket after the first (which holds at most
            :data:`FIRST_BUCKET_BYTES`).

    Returns:
        The buckets, each a list of parameter names, in the order they are summed.
    """
    buckets: list[list[str]] = []
    size, kind = 0, None
    for name in reversed(list(params)):
        t = params[name]
        nbytes = t.numel() * t.element_size()
        cap = FIRST_BUCKET_BYTES if len(buckets) <= 1 else bucket_bytes
        if not buckets or (t.dtype, t.device) != kind or (size + nbytes > min(cap, bucket_bytes) and size > 0):
            buckets.append([])
            size, kind = 0, (t.dtype, t.device)
        buckets[-1].append(name)
        size += nbytes
    return buckets


class Buckets:
    """One backward pass's buckets.  Use as a context manager: an error abandons what is in flight."""

    def __init__(
        self,
        params: dict[str, torch.Tensor],
        sync: BucketSync,
        earlier: Optional[dict[str, torch.Tensor]],
        check_finite: bool,
    ) -> None:
        """``earlier``: the summed gradients of the micro-batches before (consumed); ``check_finite``:
        append fp16's "this rank's gradients overflowed" flag to the statistics row (where
        :attr:`raympi.core.metrics.StatsLayout.rank_overflows` reads it)."""
        self.sync, self.earlier, self.check_finite = sync, earlier, check_finite
        self.flats: list[torch.Tensor] = []
        self.slot: dict[str, tuple[int, torch.Tensor]] = {}
        self.missing: list[set[str]] = []
        for names in plan_buckets(params, sync.bucket_bytes):
            first = params[names[0]]
            flat = torch.empty(sum(params[n].numel() for n in names), dtype=first.dtype, device=first.device)
            offset = 0
            for n in names:
                self.slot[n] = (len(self.flats), flat[offset : offset + params[n].numel()].view(params[n].shape))
                offset += params[n].numel()
            self.flats.append(flat)
            self.missing.append(set(names))
        self.next = 0  # the next bucket to start
        self.flags: list[torch.Tensor] = []

    def __enter__(self) -> "Buckets":
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is not None:
            self.sync.abandon()

    def watch(self, leaves: dict[str, torch.Tensor]) -> None:
        """Hook every leaf: its gradient goes into its bucket as soon as autograd has it."""
        for name, leaf in leaves.items():
            leaf.register_hook(self._hook(name))  # type: ignore[no-untyped-call]  # torch leaves it unannotated

    def _hook(self, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._put(name, grad)
            self._start_ready()
            return self.slot[name][1]  # autograd.grad returns the bucket's view; its own tensor is freed

        return hook

    def _put(self, name: str, grad: torch.Tensor) -> None:
        index, view = self.slot[name]
        if name not in self.missing[index]:
            raise TrainingError(
                f"overlap=True: the gradient of {name!r} arrived twice in one backward pass "
                "(a reentrant backward?); build the step with overlap=False"
            )
        if self.earlier is not None:
            torch.add(self.earlier.pop(name), grad, out=view)
        else:
            view.copy_(grad)
        self.missing[index].discard(name)

    def _start_ready(self) -> None:
        while self.next < len(self.flats) and not self.missing[self.next]:
            flat = self.flats[self.next]
            if self.check_finite:  # on the local gradients, before the sum overwrites them
                self.flags.append(nonfinite_flag([flat]))
            self.sync.start(flat)
            self.next += 1

    def finish(
        self, grads: dict[str, torch.Tensor], stats: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """After backward: fill in the gradients no hook saw (unused parameters: autograd's zeros),
        start what is left and the statistics row, wait for all; returns the summed ``(grads, stats)``."""
        for name, grad in grads.items():
            if name in self.missing[self.slot[name][0]]:
                self._put(name, grad)
        self._start_ready()
        if self.check_finite:
            stats = torch.cat([stats, torch.stack(self.flags).amax(0).to(stats.device)])
        stats = stats.contiguous()
        self.sync.start(stats)
        self.sync.finish()
        return {name: self.slot[name][1] for name in grads}, stats
