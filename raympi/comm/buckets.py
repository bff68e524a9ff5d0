"""Layer 2: the overlapped gradient sum, :class:`~raympi.core.overlap.BucketSync` over a communicator.

``make_train_step(overlap=True)`` hands each gradient bucket to :meth:`BucketAllreduce.start` as
soon as backward has filled it.  Each bucket is one nonblocking ``MPI_Iallreduce`` (SUM, in place)
on its host buffer, issued in the order the buckets were started (the same on every rank):

- **inline** (the default on CPU): issued at once in the caller's thread; every later ``start``
  tests the requests in flight, since MPI advances a transfer only inside its calls.
- **thread** (the default on CUDA, where the host is idle while the GPU computes): one reduction
  thread issues and waits each bucket in turn, so the transfers run while backward still runs.

On CUDA (the PyPI MPICH is not CUDA-aware) a bucket is copied to pinned host memory on a side
stream that waits for the work that wrote it, summed there, and copied back in :meth:`finish`.
A collective in flight polls :attr:`Communicator.abort` (``Communicator.wait``), and the buffers
of abandoned collectives are kept alive for the life of the process, as the communicator's own.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Optional

import torch

from raympi.comm.communicator import keep_alive
from raympi.comm.tensors import REDUCE_AS
from raympi.exceptions import CollectiveAborted, ConfigError

__all__ = ["BucketAllreduce"]


@dataclasses.dataclass
class _Bucket:
    tensor: torch.Tensor  # the caller's flat buffer
    host: torch.Tensor  # what MPI sums: ``tensor`` itself, or its host (pinned, or wider dtype) copy
    copied: Any = None  # CUDA: the event after the device-to-host copy
    request: Any = None
    done: threading.Event = dataclasses.field(default_factory=threading.Event)  # thread mode: summed (or failed)


class BucketAllreduce:
    """Sum flat gradient buckets over the ranks of ``comm`` while backward still runs.

    Args:
        comm: this rank's :class:`~raympi.comm.Communicator` (without ``compression``).
        thread: issue and wait the collectives on one reduction thread; ``None``: when the
            buckets are on CUDA.

    Raises:
        ConfigError: ``comm`` compresses its buffers (16-bit wire floats need the packing path).

    Example (in a worker, after formation)::

        step = make_train_step(model, loss_fn, opt, grad_sync=BucketAllreduce(self.comm), overlap=True)
    """

    def __init__(self, comm: Any, thread: Optional[bool] = None) -> None:
        if getattr(comm, "compression", None):
            raise ConfigError(
                f"overlap=True does not combine with compression={comm.compression!r}: "
                "set overlap=False, or compression=None"
            )
        self.comm = comm
        self.bucket_bytes: int = comm.bucket_bytes
        self.thread = thread
        self._pending: list[_Bucket] = []
        self._issued = 0  # inline mode: how many of _pending have their request
        self._pinned: dict[int, torch.Tensor] = {}  # per bucket position: pinned buffers reused step to step
        self._side: dict[torch.device, Any] = {}  # per GPU: the stream of the copies to the host
        self._queue: queue.SimpleQueue[Optional[_Bucket]] = queue.SimpleQueue()
        self._cancel = threading.Event()
        self._worker: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None

    def start(self, bucket: torch.Tensor) -> None:
        """Stage ``bucket`` for the host when it is on a GPU and start (or queue) its sum."""
        if self.comm.abort.is_set():
            raise CollectiveAborted(f"rank {self.comm.rank}: collective abandoned on request (a peer failed)")
        entry = self._stage(bucket, len(self._pending))
        self._pending.append(entry)
        if self._threaded(bucket):
            self._ensure_worker()
            self._queue.put(entry)
        else:
            self._pump()

    def finish(self) -> None:
        """Wait for every bucket started since the last ``finish`` and write the sums back."""
        pending = self._pending
        try:
            for b in pending:  # each one back as soon as its own sum is done (the device copies overlap later sums)
                if self._threaded(b.tensor):
                    b.done.wait()  # the thread's own wait polls abort
                    if self._error is not None:
                        raise self._error
                elif b.request is None and not b.done.is_set():
                    self._issue(b)  # its turn came after the last hook
                if b.request is not None:
                    self.comm.wait(b.request, b.host.numpy())
                    b.request = None
                    b.done.set()
                if b.host is not b.tensor:
                    b.tensor.copy_(b.host, non_blocking=b.tensor.is_cuda)
            for device, side in self._side.items():  # the next step's copies into the pinned buffers wait for these
                side.wait_stream(torch.cuda.current_stream(device))
        except BaseException:
            self.abandon()
            raise
        self._pending, self._issued = [], 0

    def abandon(self) -> None:
        """Keep every bucket in flight alive for MPI (for good) and forget them; never reuse their buffers."""
        for i, b in enumerate(self._pending):
            if not b.done.is_set() or b.request is not None:
                keep_alive(b.request, b.host, b.tensor)
                self._pinned.pop(i, None)
        self._pending, self._issued = [], 0
        self.close()  # the thread issues nothing more; a fresh one serves the next step

    def close(self) -> None:
        """Let the reduction thread end (when this communicator is done with, or after an abandon)."""
        if self._worker is not None:
            self._cancel.set()
            self._queue.put(None)
            self._worker = None

    # ------------------------------------------------------------------ staging and issuing

    def _stage(self, bucket: torch.Tensor, index: int) -> _Bucket:
        wire = REDUCE_AS.get(bucket.dtype, bucket.dtype)
        if not bucket.is_cuda:
            return _Bucket(bucket, bucket if wire == bucket.dtype else bucket.to(wire))
        host = self._pinned.get(index)
        if host is None or host.numel() != bucket.numel() or host.dtype != wire:
            host = self._pinned[index] = torch.empty(bucket.numel(), dtype=wire, pin_memory=True)
        side = self._side.get(bucket.device)
        if side is None:
            # torch.cuda.Stream is unannotated
            side = self._side[bucket.device] = torch.cuda.Stream(bucket.device)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(bucket.device))  # after the kernels that wrote the bucket
        with torch.cuda.stream(side):
            host.copy_(bucket, non_blocking=True)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda's are unannotated
            copied.record(side)
        bucket.record_stream(side)  # its memory is not reused before the copy has read it
        return _Bucket(bucket, host, copied)

    def _threaded(self, bucket: torch.Tensor) -> bool:
        return self.thread if self.thread is not None else bucket.is_cuda

    def _issue(self, b: _Bucket) -> None:
        if b.copied is not None:
            b.copied.synchronize()  # the host copy is complete (a no-op when already so)
        b.request = self.comm.iallreduce(b.host.numpy())

    def _pump(self) -> None:
        """Inline mode: issue the ready buckets in order, and let MPI advance the ones in flight."""
        while self._issued < len(self._pending):
            b = self._pending[self._issued]
            if b.copied is not None and not b.copied.query():
                break  # its copy to the host is not done yet: later (the order must stay the same)
            self._issue(b)
            self._issued += 1
        for b in self._pending[: self._issued]:
            if b.request is not None and b.request.Test():  # raises when MPI reports a lost peer
                b.request = None
                b.done.set()

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._queue, self._cancel, self._error = queue.SimpleQueue(), threading.Event(), None
            self._worker = threading.Thread(
                target=self._serve,
                args=(self._queue, self._cancel),
                daemon=True,
                name=f"raympi-allreduce-{self.comm.rank}",
            )
            self._worker.start()

    def _serve(self, jobs: "queue.SimpleQueue[Optional[_Bucket]]", cancel: threading.Event) -> None:
        """The reduction thread: each bucket in turn, issued and waited; after an error or abandon, none more."""
        failed = False
        while (b := jobs.get()) is not None:
            try:
                if not (failed or cancel.is_set()):
                    self._issue(b)
                    self.comm.wait(b.request, b.host.numpy())  # polls abort; keeps an abandoned buffer alive
                    b.request = None
            except BaseException as exc:  # told to the step's thread in finish()
                failed = True
                if not cancel.is_set():
                    self._error = exc
            finally:
                b.done.set()
