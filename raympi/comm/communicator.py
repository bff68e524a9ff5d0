"""Layer 2: collectives on torch tensors over one MPI communicator of Ray actors.

A :class:`Communicator` wraps the intracommunicator that :func:`raympi.comm.form` leaves in each
member (``self.comm``): a bucketed in-place ``allreduce_`` of any tree of tensors (optionally sent
as 16-bit floats), ``broadcast`` of a state tree, and ``barrier``.  Every collective polls its
request, so another thread can abandon it (:attr:`Communicator.abort`) when a peer failed.
Forming the group is :mod:`raympi.comm.formation`'s job.

Example (inside a member actor, after formation)::

    self.comm.allreduce_([grad_a, grad_b])     # in-place sum over ranks
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
import warnings
from typing import Any

import torch

from raympi.comm import library
from raympi.core import pytree
from raympi.exceptions import CollectiveAborted, ConfigError

__all__ = ["Communicator", "DEFAULT_BUCKET_BYTES"]

DEFAULT_BUCKET_BYTES = 16 * 2**20
# Below this a tensor is packed with others (one call for many small ones); above, copying it
# into a buffer costs more than the extra MPI call (measured: per-parameter calls beat one
# copied flat buffer for a 5.8M-parameter MLP).
INPLACE_MIN_BYTES = 256 * 2**10
# How long a rank polls a collective flat out before it starts sleeping between polls.
SPIN_S = 0.02

# MPI has no 16-bit float types: such tensors are summed in float32 (exact
# accumulation, one rounding back) at twice the bytes on the wire.
_REDUCE_AS = {torch.bfloat16: torch.float32, torch.float16: torch.float32}
# (request, buffer) of every collective abandoned in this process: MPI may still write into the buffer.
_ABANDONED: list[tuple[Any, Any]] = []
# Optional compression: float32 gradients travel as 16-bit floats and are summed by a user-defined op.
_WIRE = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}
_REDUCIBLE = {torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8}


class Communicator:
    """Collectives on torch tensors over one MPI intracommunicator.

    Building one is collective (every rank of ``comm`` must do it): the ranks tell each other their
    hosts, to know whether more ranks than CPUs share this one.

    Args:
        comm: an ``mpi4py.MPI.Intracomm`` this object now owns.
        bucket_bytes: the most bytes one ``Allreduce`` call carries.
        compression: ``"bf16"`` / ``"fp16"`` to send float32 tensors as 16-bit floats, or ``None``.
    """

    def __init__(self, comm: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, compression: str | None = None) -> None:
        if bucket_bytes < 8:
            raise ConfigError(f"bucket_bytes must be at least 8, got {bucket_bytes}")
        if compression not in _WIRE:
            raise ConfigError(f"compression must be one of {sorted(k for k in _WIRE if k)} or None, got {compression!r}")
        self.mpi = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        self.abort = threading.Event()  # set from another thread to abandon the collective in flight
        self._MPI = library.require()
        self._wire_op = self._MPI.Op.Create(_sum_16bit(_WIRE[compression]), commute=True) if compression else None
        # More ranks on this host than CPUs for them: waiting ranks must give their core away.
        hosts = comm.allgather(socket.gethostname())
        self.oversubscribed = hosts.count(socket.gethostname()) > len(os.sched_getaffinity(0))

    def allreduce_(self, tensors: Any) -> Any:
        """Sum every tensor of ``tensors`` (a list, dict or any tree) over all ranks, in place.

        A large contiguous CPU tensor of a dtype MPI can sum (at least ``INPLACE_MIN_BYTES``) is
        reduced where it lies, no copy.  The others are packed by dtype into one flat buffer and
        copied back after.  Either way each ``bucket_bytes`` slice is one ``MPI_Allreduce``, and
        the tensors keep their shapes and dtypes.  With ``compression``, float32 tensors are packed
        into 16-bit float buffers instead, summed by a user-defined MPI op, and written back as float32.

        Returns:
            ``tensors`` itself, now holding the sums.
        """
        packed: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in pytree.tensor_leaves(tensors):
            wire = _REDUCE_AS.get(t.dtype, t.dtype)
            if wire not in _REDUCIBLE:
                raise TypeError(f"allreduce cannot sum tensors of dtype {t.dtype}")
            if self.compression and t.dtype == torch.float32:
                wire = _WIRE[self.compression]
            if t.dtype == wire and t.is_contiguous() and not t.is_cuda and t.numel() * t.element_size() >= INPLACE_MIN_BYTES:
                self._reduce_flat(t.detach().view(-1))
            else:
                packed.setdefault(wire, []).append(t)
        for wire, group in packed.items():
            flat = torch.empty(sum(t.numel() for t in group), dtype=wire, device=group[0].device)
            offset = 0
            for t in group:  # one copy in, casting to the wire dtype on the way
                flat[offset : offset + t.numel()].view(t.shape).copy_(t.detach())
                offset += t.numel()
            host = _to_host(flat)
            self._reduce_flat(host)
            flat = _from_host(host, flat)
            offset = 0
            for t in group:
                t.detach().copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()
        return tensors

    def _reduce_flat(self, flat: torch.Tensor) -> None:
        """Sum a flat CPU tensor over all ranks in place, one MPI call per bucket.

        A 16-bit float tensor (only under ``compression``) travels as 16-bit integers and is summed by
        the user-defined op (each pairwise sum rounds to 16 bits; the caller writes it back as float32).
        """
        step = max(1, self.bucket_bytes // flat.element_size())
        if flat.dtype in (torch.bfloat16, torch.float16):
            array = flat.view(torch.int16).numpy()
            for start in range(0, array.size, step):
                part = array[start : start + step]
                self._wait(self.mpi.Iallreduce(self._MPI.IN_PLACE, [part, self._MPI.INT16_T], op=self._wire_op), part)
            return
        array = flat.numpy()
        for start in range(0, array.size, step):
            self._allreduce_buffer(array[start : start + step])

    def _allreduce_buffer(self, array: Any) -> None:
        self._wait(self.mpi.Iallreduce(self._MPI.IN_PLACE, array, op=self._MPI.SUM), array)

    def _wait(self, request: Any, buffer: Any) -> None:
        """Complete a nonblocking collective on ``buffer``, unless :attr:`abort` is set first (then raise).

        A blocking call could never be abandoned: polling lets a rank whose peer hung or died give
        up the step in flight and keep its state for a warm restart.  MPI may still write into the
        buffer of an abandoned collective (inside any later MPI call: forming the next group, say),
        so that buffer is kept alive for the life of the process, never handed back to malloc.
        """
        spins, since = 0, 0.0
        spin_s = SPIN_S if getattr(buffer, "nbytes", 0) >= INPLACE_MIN_BYTES else 0.0
        try:
            while not request.Test():  # raises when MPI reports a lost peer (ERRORS_RETURN)
                if self.abort.is_set():
                    raise CollectiveAborted(f"rank {self.rank}: collective abandoned on request (a peer failed)")
                spins += 1
                if spins <= 1000:
                    continue
                # A large transfer is polled without sleeping for up to SPIN_S: shared-memory transfers
                # advance only inside Test (sleeping 20 us between polls made a 23 MB allreduce 40% slower).
                # Otherwise let the core go (other ranks may share it), and poll only every ms once a
                # peer has kept us waiting for a second (it is probably gone: the abort will come).
                since = since or time.monotonic()
                waited = time.monotonic() - since
                if waited > 1.0:
                    time.sleep(1e-3)
                elif waited > spin_s:
                    time.sleep(20e-6)
                elif self.oversubscribed:
                    os.sched_yield()  # let a rank that shares this core compute (measured: 4 ranks on 2 cores)
        except BaseException:
            _ABANDONED.append((request, buffer))
            raise

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        """Send ``tree`` (any tree of tensors and picklable leaves) from ``root`` to every rank.

        Other ranks may pass ``None``; they receive a new tree of CPU tensors.
        The structure travels pickled; the tensor bytes travel as one ``MPI_Bcast``.

        Returns:
            The root's tree on every rank (the root gets its own object back).
        """
        if self.rank == root:
            leaves, spec = pytree.flatten(tree)
            layout = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("obj", x) for x in leaves]
            tensors = [x.detach().contiguous().cpu() for x in leaves if isinstance(x, torch.Tensor)]
            payload = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
            self.mpi.bcast((spec, layout, payload.numel()), root=root)
        else:
            spec, layout, nbytes = self.mpi.bcast(None, root=root)
            payload = torch.empty(nbytes, dtype=torch.uint8)
        if payload.numel():
            self.mpi.Bcast(payload.numpy(), root=root)
        if self.rank == root:
            return tree
        leaves, offset = [], 0
        for kind, value in layout:
            if kind == "obj":
                leaves.append(value)
                continue
            shape, dtype = kind, value
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            leaves.append(payload[offset : offset + nbytes].clone().view(dtype).view(shape))  # clone: aligned storage
            offset += nbytes
        return pytree.unflatten(leaves, spec)

    def barrier(self) -> None:
        """Block until every rank has called it."""
        self.mpi.Barrier()

    def free(self) -> None:
        """Release the MPI communicator."""
        if self.mpi is not None:
            self.mpi.Free()
            self.mpi = None
        if self._wire_op is not None:
            self._wire_op.Free()
            self._wire_op = None


def _sum_16bit(dtype: torch.dtype) -> Any:
    """An MPI reduction function summing buffers of 16-bit floats of ``dtype`` (MPI has no such type)."""
    def op(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        with warnings.catch_warnings():  # MPI may hand a read-only input buffer; it is only read
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(inoutbuf, dtype=dtype).add_(torch.frombuffer(inbuf, dtype=dtype))
    return op


def _to_host(flat: torch.Tensor) -> torch.Tensor:
    # The PyPI MPICH is not CUDA-aware: GPU buffers are staged through pinned host memory.
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat)
        return host
    return flat


def _from_host(host: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    if flat.is_cuda:
        flat.copy_(host, non_blocking=False)
    return flat
