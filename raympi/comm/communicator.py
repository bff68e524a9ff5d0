"""Layer 2: collectives over one MPI communicator of Ray actors, on numpy buffers and torch tensors.

A :class:`Communicator` wraps the intracommunicator that :func:`raympi.comm.form` leaves in each
member (``self.comm``): a bucketed in-place ``allreduce_`` of any tree of tensors (optionally sent
as 16-bit floats), ``allreduce_array_`` of a numpy array, ``broadcast`` of a state tree or of plain
objects, and ``barrier``.  Every reduction polls its request, so another thread can abandon it
(:attr:`Communicator.abort`) when a peer failed.  Forming the group is
:mod:`raympi.comm.formation`'s job.

torch is imported only on the tensor paths (:mod:`raympi.comm.tensors`): a "light" member, a
process without torch, can form a group, reduce arrays, broadcast plain objects and wait at barriers.

Example (inside a member actor, after formation)::

    self.comm.allreduce_([grad_a, grad_b])     # in-place sum over ranks
    self.comm.allreduce_array_(np.ones(4))     # the same on a numpy array, no torch needed
"""

from __future__ import annotations

import os
import socket
import sys
import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np

from raympi.comm import library
from raympi.comm.wire import COMPRESSIONS, INPLACE_MIN_BYTES
from raympi.exceptions import CollectiveAborted, ConfigError

__all__ = ["Communicator", "DEFAULT_BUCKET_BYTES", "abandoned_bytes", "keep_alive"]

DEFAULT_BUCKET_BYTES = 16 * 2**20
# How long a rank polls a collective flat out before it starts sleeping between polls.
SPIN_S = 0.02

# Everything an abandoned collective may still touch (its request, buffers, the group itself): a
# library thread may write into it later, so it is never handed back to the allocator.
_ABANDONED: list[tuple[Any, ...]] = []


def keep_alive(*objects: Any) -> None:
    """Keep ``objects`` (an abandoned collective's request, buffers, group) alive until the process ends, or,
    where the first is an MPI request, until MPI is done with it: the entries whose request has completed
    since (or failed: a lost peer) are let go here.  The memory held is then that of the collectives still
    waiting for a peer that never answers (with ``shard_optimizer``, a flat buffer of the parameters each)."""
    _ABANDONED[:] = [entry for entry in _ABANDONED if not _over(entry)]
    _ABANDONED.append(objects)


def abandoned_bytes() -> int:
    """Bytes of the numpy buffers and tensors kept alive for abandoned collectives (after letting go of those done)."""
    _ABANDONED[:] = [entry for entry in _ABANDONED if not _over(entry)]
    return sum(getattr(x, "nbytes", 0) for entry in _ABANDONED for x in entry)


def _over(entry: tuple[Any, ...]) -> bool:
    """Whether MPI is done with an abandoned collective (its request completed or failed)."""
    test = getattr(entry[0], "Test", None) if entry else None
    if test is None:
        return False
    try:
        return bool(test())
    except Exception:  # completed in error (ERRORS_RETURN): MPI no longer touches its buffers
        return True


class Communicator:
    """Collectives on numpy buffers and torch tensors over one MPI intracommunicator.

    Building one is collective (every rank of ``comm`` must do it): the ranks tell each other their
    hosts, to know whether more ranks than CPUs share this one.  It needs no torch unless
    ``compression`` is set.

    Args:
        comm: an ``mpi4py.MPI.Intracomm`` this object now owns.
        bucket_bytes: the most bytes one ``Allreduce`` call carries.
        compression: ``"bf16"`` / ``"fp16"`` to send float32 tensors as 16-bit floats, or ``None``.
    """

    def __init__(self, comm: Any, bucket_bytes: int = DEFAULT_BUCKET_BYTES, compression: str | None = None) -> None:
        if bucket_bytes < 8:
            raise ConfigError(f"bucket_bytes must be at least 8, got {bucket_bytes}")
        if compression is not None and compression not in COMPRESSIONS:
            raise ConfigError(f"compression must be one of {sorted(COMPRESSIONS)} or None, got {compression!r}")
        self.mpi = comm
        self.rank: int = comm.Get_rank()
        self.size: int = comm.Get_size()
        self.bucket_bytes = bucket_bytes
        self.compression = compression
        #: Set from another thread to abandon the collective in flight (it raises ``CollectiveAborted``).
        self.abort = threading.Event()
        #: Seconds spent waiting for a collective to complete (:meth:`waiting`), since the communicator was made.
        self.collective_s = 0.0
        #: When the wait for the collective in progress began (monotonic); 0.0 when none is (read by the health
        #: thread: a rank waiting in a collective is not the one that keeps its peers waiting).
        self.in_collective_since = 0.0
        self.MPI = library.require()  # the mpi4py.MPI module
        self._wire_op = None
        if compression:
            from raympi.comm import tensors

            self._wire_op = self.MPI.Op.Create(tensors.sum_16bit(compression), commute=True)
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
        from raympi.comm import tensors as _tensors  # torch: only on this path

        return _tensors.allreduce_tree_(self._reduce_flat, tensors, self.compression)

    def allreduce_array_(self, array: Any) -> Any:
        """Sum a numpy array (or a writable buffer such as a ``bytearray``) over all ranks, in place; no torch needed.

        The array must be C-contiguous and writable, of an integer, float32/64 or complex dtype.  Each
        ``bucket_bytes`` slice is one ``MPI_Allreduce`` that :attr:`abort` can abandon, as in
        :meth:`allreduce_` (``compression`` does not apply here).

        Returns:
            ``array`` itself, now holding the sums.

        Example:
            >>> self.comm.allreduce_array_(np.full(4, float(self.comm.rank)))  # doctest: +SKIP
            array([6., 6., 6., 6.])  # over 4 ranks
        """
        flat = array if isinstance(array, np.ndarray) else np.asarray(memoryview(array))  # a view, never a copy
        if not (flat.flags.c_contiguous and flat.flags.writeable):
            raise TypeError("allreduce_array_ needs a C-contiguous, writable array (np.ascontiguousarray makes one)")
        if flat.dtype.kind not in "iufc" or flat.dtype == np.float16:
            raise TypeError(f"allreduce_array_ cannot sum arrays of dtype {flat.dtype} (cast 16-bit floats to float32)")
        self._reduce_array(flat.reshape(-1))
        return array

    def _reduce_flat(self, flat: Any, summed: Callable[[int, int], None] | None = None) -> None:
        """Sum a flat CPU tensor over all ranks in place, one MPI call per bucket; ``summed(start, stop)``
        is told of each bucket as soon as its sum is in (to copy it on while the next is summed).

        A 16-bit float tensor (only under ``compression``) travels as 16-bit integers and is summed by
        the user-defined op (each pairwise sum rounds to 16 bits; the caller writes it back as float32).
        """
        from raympi.comm import tensors as _tensors

        array = _tensors.as_16bit_ints(flat)
        if array is not None:
            step = max(1, self.bucket_bytes // array.itemsize)
            for start in range(0, array.size, step):
                part = array[start : start + step]
                self.wait(self.mpi.Iallreduce(self.MPI.IN_PLACE, [part, self.MPI.INT16_T], op=self._wire_op), part)
                if summed is not None:
                    summed(start, start + part.size)
            return
        self._reduce_array(flat.numpy(), summed)

    def _reduce_array(self, array: np.ndarray, summed: Callable[[int, int], None] | None = None) -> None:
        """Sum a flat numpy array over all ranks in place, one MPI call per ``bucket_bytes``."""
        step = max(1, self.bucket_bytes // array.itemsize)
        for start in range(0, array.size, step):
            self._allreduce_buffer(array[start : start + step])
            if summed is not None:
                summed(start, min(start + step, array.size))

    def _allreduce_buffer(self, array: Any) -> None:
        self.wait(self.iallreduce(array), array)

    def iallreduce(self, array: Any) -> Any:
        """Start an in-place nonblocking SUM of a numpy buffer over all ranks; complete it with :meth:`wait`."""
        return self.mpi.Iallreduce(self.MPI.IN_PLACE, array, op=self.MPI.SUM)

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        """Count the time inside in :attr:`collective_s`, and mark this rank as inside a collective meanwhile."""
        outer = self.in_collective_since == 0.0
        start = time.monotonic()
        if outer:
            self.in_collective_since = start
        try:
            yield
        finally:
            if outer:
                self.collective_s += time.monotonic() - start
                self.in_collective_since = 0.0

    def wait(self, request: Any, buffer: Any) -> None:
        """Complete a nonblocking collective on ``buffer``, unless :attr:`abort` is set first (then raise).

        A blocking call could never be abandoned: polling lets a rank whose peer hung or died give
        up the step in flight and keep its state for a warm restart.  MPI may still write into the
        buffer of an abandoned collective (inside any later MPI call: forming the next group, say),
        so that buffer is kept alive for the life of the process, never handed back to malloc.
        """
        spin_s = SPIN_S if getattr(buffer, "nbytes", 0) >= INPLACE_MIN_BYTES else 0.0
        try:
            with self.waiting():
                self._poll(request, spin_s)
        except BaseException:
            keep_alive(request, buffer)
            raise

    def _poll(self, request: Any, spin_s: float) -> None:
        """:meth:`wait`'s loop: ``MPI_Test`` until done, spinning ``spin_s`` at most before it sleeps between tests."""
        spins, since = 0, 0.0
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

    # ---------------------------------------------------------------- sharded optimizer state (raympi.core.shard)

    def reduce_scatter(self, flat: Any, counts: Any) -> Any:
        """Sum the flat tensor ``flat`` over all ranks and return this rank's chunk of the sums.

        Rank ``r``'s chunk is ``counts[r]`` elements at offset ``r * max(counts)`` (``flat`` may be padded
        past ``sum(counts)``).  One ``MPI_Ireduce_scatter`` with ``MPI_IN_PLACE``, polled as :meth:`wait`
        does: on ``flat`` itself when it is a CPU tensor MPI can sum (its contents are then overwritten),
        else on a host copy (16-bit floats summed in float32).  ``compression`` does not apply.

        Returns:
            ``counts[rank]`` elements of ``flat``'s dtype and device: a view of ``flat``'s start where MPI
            summed in it, else a new tensor.
        """
        import torch
        from raympi.comm import tensors as _tensors

        chunk, total = max(counts), sum(counts)
        wire = _tensors.REDUCE_AS.get(flat.dtype, flat.dtype)
        host = flat[:total].to("cpu", wire)  # flat itself where it can be summed as it is
        # Rank r's chunk starts at r * chunk: with the exact counts it sits at sum(counts[:r]) only while
        # every earlier chunk is full, which the layout guarantees (only the last chunks are short).
        assert all(c == chunk for c in counts[: self.rank]), "only the last chunks may be shorter"
        array = host.numpy()
        self.wait(self.mpi.Ireduce_scatter(self.MPI.IN_PLACE, array, list(counts), op=self.MPI.SUM), array)
        if host.data_ptr() == flat.data_ptr():  # summed where it lay: the result is flat's first elements
            return flat[: counts[self.rank]]
        return torch.from_numpy(array[: counts[self.rank]]).to(flat.device, flat.dtype)

    def all_gather_(self, flat: Any, counts: Any) -> Any:
        """Fill ``flat`` in place with every rank's chunk (rank ``r``'s ``counts[r]`` elements at ``r * max(counts)``,
        taken from that rank's ``flat``): one ``MPI_Iallgatherv`` with ``MPI_IN_PLACE``, polled.

        Returns:
            ``flat``.
        """
        import torch
        from mpi4py.util import dtlib

        chunk = max(counts)
        host = flat if flat.device.type == "cpu" else flat.cpu()
        sixteen = host.dtype in (torch.bfloat16, torch.float16)  # nothing is summed: the bits travel as int16
        array = (host.view(torch.int16) if sixteen else host).numpy()
        displs = [r * chunk for r in range(self.size)]
        spec = [array, (list(counts), displs), dtlib.from_numpy_dtype(array.dtype)]
        self.wait(self.mpi.Iallgatherv(self.MPI.IN_PLACE, spec), array)
        if host is not flat:
            flat.copy_(host)
        return flat

    def sum_(self, value: Any) -> Any:
        """Sum a (small) tensor over all ranks in place and return it."""
        self.allreduce_([value])
        return value

    def shift_(self, mine: Any, counts: Any, by: int) -> Any:
        """Send the tensor ``mine`` to rank ``rank - by`` and return rank ``rank + by``'s (``counts[rank + by]``
        elements of ``mine``'s dtype and device; ranks mod ``size``): one ``MPI_Isendrecv``, polled."""
        import torch

        source, dest = (self.rank + by) % self.size, (self.rank - by) % self.size
        host = mine.detach().to("cpu").contiguous()
        out = torch.empty(counts[source], dtype=host.dtype)
        sixteen = host.dtype in (torch.bfloat16, torch.float16)  # numpy has no bfloat16: the bits travel as int16
        send, recv = ((t.view(torch.int16) if sixteen else t).numpy() for t in (host, out))
        try:
            self.wait(self.mpi.Isendrecv(send, dest, 0, recv, source, 0), recv)
        except BaseException:
            keep_alive(send)
            raise
        return out.to(mine.device)

    def broadcast(self, tree: Any, root: int = 0) -> Any:
        """Send ``tree`` (any tree of tensors and picklable leaves) from ``root`` to every rank.

        Other ranks may pass ``None``; they receive a new tree of CPU tensors.
        The structure travels pickled; the tensor bytes travel as one ``MPI_Bcast``.  A root
        without torch (a light member) holds no tensors: its tree travels pickled, whole.

        Returns:
            The root's tree on every rank (the root gets its own object back).
        """
        if self.rank == root:
            if "torch" not in sys.modules:  # no tensor can exist in this process
                self.mpi.bcast((None, tree), root=root)
                return tree
            from raympi.comm import tensors as _tensors

            header, payload = _tensors.pack_tree(tree)
            self.mpi.bcast((header, None), root=root)
        else:
            header, plain = self.mpi.bcast(None, root=root)
            if header is None:
                return plain
            from raympi.comm import tensors as _tensors

            payload = _tensors.empty_payload(header[2])
        if payload.numel():
            self.mpi.Bcast(payload.numpy(), root=root)
        if self.rank == root:
            return tree
        return _tensors.unpack_tree(header[0], header[1], payload)

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
