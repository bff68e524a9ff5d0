"""Layer 2: gradient sums over a torch.distributed process group (NCCL or gloo) built from the MPI communicator.

MPI stays the control plane: it forms the group, holds membership, broadcasts state and abandons a
failed step.  The gradients may take another data plane, Horovod's split: :func:`connect` is
collective over a :class:`~raympi.comm.Communicator`; rank 0 opens a ``TCPStore`` on a free port and
sends its address to the others with an MPI broadcast (no environment variables, no torchrun, no
second rendezvous service), and every rank builds the backend from that store.

:class:`ProcessGroupSum` is both a ``grad_sync`` (a tree summed in place) and a
:class:`~raympi.core.overlap.BucketSync` (buckets summed while backward runs):

- **NCCL**: each bucket is all-reduced on NCCL's own stream as soon as it is started, with no host
  copy and no polling thread; :meth:`ProcessGroupSum.finish` only makes the current stream wait for
  it (``Work.wait``), so the host blocks only where the step reads the sums.  A failure is cut short
  by :meth:`ProcessGroupSum.abort` (``ProcessGroupNCCL.abort``) from the worker's health thread.
- **gloo** (CPU, so the whole path runs here): the step's thread waits on each bucket's future and
  polls :attr:`Communicator.abort` meanwhile, as MPI's requests are polled.  ``ProcessGroupGloo.abort``
  does not interrupt an operation in flight (measured: it ran on to the group's timeout), so a
  group that abandoned one is kept alive with its buffers until the process ends.

16-bit gradients are summed in their own dtype unless ``fp32_reduce`` (then in float32, as MPI does).
"""

from __future__ import annotations

import dataclasses
import datetime
import threading
import time
from typing import Any, Callable, Optional, cast

import torch
from torch import distributed as dist

from raympi.comm.communicator import Communicator, keep_alive
from raympi.comm.wire import INPLACE_MIN_BYTES
from raympi.core import pytree
from raympi.exceptions import CollectiveAborted, ConfigError, FormationError

__all__ = ["TRANSPORTS", "ProcessGroupSum", "connect"]

TRANSPORTS = ("mpi", "gloo", "nccl")
# Looked up, not imported: a torch without distributed support has none (connect() refuses it first).
TCPStore: Any = getattr(dist, "TCPStore", None)
_SIXTEEN = (torch.bfloat16, torch.float16)
POLL_S = 0.05  # how often a gloo wait looks at the abort flag (the future's callback wakes it at once)


def connect(
    comm: Communicator, backend: str, address: str, timeout_s: float = 120.0, *, fp32_reduce: bool = False
) -> "ProcessGroupSum":
    """Build a ``backend`` process group over the ranks of ``comm``; collective over ``comm``.

    Args:
        comm: the MPI communicator whose ranks (and rank numbers) the process group takes.
        backend: ``"nccl"`` (CUDA tensors, one GPU per rank) or ``"gloo"``.
        address: this rank's IP address or host name as the other ranks reach it (rank 0's hosts the store).
        timeout_s: the rendezvous deadline, and how long an operation of the group may block before
            the backend gives it up (abandoned operations end by then at the latest).
        fp32_reduce: sum 16-bit gradients in float32 (twice the bytes; the MPI transport always does).

    Returns:
        This rank's :class:`ProcessGroupSum`, proven by one small sum over every rank.

    Raises:
        ConfigError: an unknown backend, or one this torch build lacks.
        FormationError: the store or the process group could not be set up (every rank raises).

    Example (inside a member actor, after :func:`raympi.comm.form`)::

        sync = connect(self.comm, "gloo", ray.util.get_node_ip_address())
        make_train_step(model, loss_fn, opt, grad_sync=sync, overlap=True)
    """
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"grad_transport must be one of {list(TRANSPORTS)}, got {backend!r}")
    available = dist.is_nccl_available() if backend == "nccl" else dist.is_gloo_available()
    if not available:
        raise ConfigError(
            f"grad_transport={backend!r}: this torch build has no {backend} (torch.distributed."
            f"is_{backend}_available() is False); use grad_transport='mpi'"
        )
    timeout = datetime.timedelta(seconds=timeout_s)
    store, fault = None, None
    if comm.rank == 0:
        try:
            store = TCPStore(address, 0, comm.size, True, timeout=timeout, wait_for_workers=False)
            found: tuple[str, Optional[int], Optional[str]] = (address, store.port, None)
        except Exception as exc:  # told to every rank before anyone waits on the store
            found = (address, None, f"{type(exc).__name__}: {exc}")
        found = comm.mpi.bcast(found, root=0)
    else:
        found = comm.mpi.bcast(None, root=0)
    host, port, fault = found
    try:
        if fault is None:
            if store is None:
                # No fault: rank 0 made the store and sent its port.
                store = TCPStore(host, cast(int, port), comm.size, False, timeout=timeout)
            pg = _backend(backend, store, comm.rank, comm.size, address, timeout)
            proof = torch.ones(1, device="cuda" if backend == "nccl" else "cpu")
            pg.allreduce([proof]).wait()
            if backend == "nccl":
                torch.cuda.current_stream().synchronize()
            if int(proof.item()) != comm.size:
                fault = f"a test sum over {comm.size} ranks gave {proof.item()}"
    except Exception as exc:
        fault = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    verdicts = comm.mpi.allgather(fault)  # the same outcome on every rank
    faults = [f"rank {r}: {f}" for r, f in enumerate(verdicts) if f]
    if faults:
        raise FormationError(
            f"the {backend} process group over {comm.size} ranks (store on {host}) could not "
            f"be built: {'; '.join(faults)}; use grad_transport='mpi' to sum gradients over MPI"
        )
    return ProcessGroupSum(comm, pg, backend, store, fp32_reduce=fp32_reduce)


def _backend(backend: str, store: Any, rank: int, size: int, address: str, timeout: datetime.timedelta) -> Any:
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, not in torch's stubs
    options._timeout = timeout
    # Bind to the address the others reach us at (the default resolves the host name, which may not).
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _completion(work: Any) -> threading.Event:
    """Set when a gloo operation is done (by its future's callback): what a wait polls."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    return done


@dataclasses.dataclass
class _Work:
    bucket: torch.Tensor  # the caller's flat buffer
    wire: torch.Tensor  # what the backend sums: ``bucket`` itself, or its float32 copy
    work: Any
    done: Optional[threading.Event]  # gloo: set by the future's callback; NCCL: None (stream-ordered)


class ProcessGroupSum:
    """In-place sums over a torch.distributed process group: a ``grad_sync`` and a ``BucketSync``.

    Built by :func:`connect`.  Calling it sums a tree of tensors (``make_train_step``'s
    ``{"grads": ..., "stats": ...}``); :meth:`start` / :meth:`finish` / :meth:`abandon` sum the
    buckets of ``make_train_step(overlap=True)``.
    """

    def __init__(self, comm: Communicator, pg: Any, backend: str, store: Any, fp32_reduce: bool = False) -> None:
        self.comm, self.pg, self.backend, self.store = comm, pg, backend, store
        self.rank, self.size = comm.rank, comm.size  # (a ShardSync)
        self.bucket_bytes: int = comm.bucket_bytes
        self.fp32_reduce = fp32_reduce
        self._pending: list[_Work] = []

    def __call__(self, tree: Any) -> None:
        """Sum every tensor of ``tree`` over the ranks, in place: large contiguous tensors where they
        lie, the others packed per dtype and device into flat buffers; ``bucket_bytes`` per call."""
        packed: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in pytree.tensor_leaves(tree):
            if t.is_contiguous() and t.numel() * t.element_size() >= INPLACE_MIN_BYTES:
                self._start_sliced(t.detach().view(-1))
            else:
                packed.setdefault((t.dtype, t.device), []).append(t)
        flats = []
        for group in packed.values():
            flat = torch.cat([t.detach().reshape(-1) for t in group])
            flats.append((flat, group))
            self._start_sliced(flat)
        self.finish()
        for flat, group in flats:
            offset = 0
            for t in group:
                t.detach().copy_(flat[offset : offset + t.numel()].view(t.shape))
                offset += t.numel()

    def _start_sliced(self, flat: torch.Tensor) -> None:
        step = max(1, self.bucket_bytes // flat.element_size())
        for start in range(0, flat.numel(), step):
            self.start(flat[start : start + step])

    def reduce_scatter(self, flat: torch.Tensor, counts: Any) -> torch.Tensor:
        """Sum ``flat`` (padded to ``max(counts) * size`` elements) over the ranks; return this rank's
        ``counts[rank]`` elements (a :class:`~raympi.core.shard.ShardSync`).

        NCCL runs ``reduce_scatter_tensor``; gloo has no working one for CPU tensors here (its work has no
        future, and did not complete): it sums the whole buffer, as its own reduce-scatter would."""
        chunk, rank = max(counts), self.comm.rank
        if self.backend != "nccl":
            self._start_sliced(flat)  # (flat is the caller's to overwrite)
            self.finish()
            return flat[rank * chunk : rank * chunk + counts[rank]].clone()
        wire = flat.float() if self.fp32_reduce and flat.dtype in _SIXTEEN else flat
        out = torch.empty(chunk, dtype=wire.dtype, device=wire.device)
        self._collective(lambda: self.pg._reduce_scatter_base(out, wire), out)
        return out[: counts[rank]].to(flat.dtype, copy=True)

    def all_gather_(self, flat: torch.Tensor, counts: Any) -> torch.Tensor:
        """Fill ``flat`` (padded as above) in place with every rank's chunk, each taken from its own rank
        (gloo: a sum of buffers that are zero outside each rank's own chunk)."""
        chunk, rank = max(counts), self.comm.rank
        if self.backend != "nccl":
            flat[: rank * chunk].zero_()
            flat[(rank + 1) * chunk :].zero_()
            self._start_sliced(flat)
            self.finish()
            return flat
        mine = flat[rank * chunk : (rank + 1) * chunk].clone()
        self._collective(lambda: self.pg._allgather_base(flat, mine), flat, mine)
        return flat

    def sum_(self, value: torch.Tensor) -> torch.Tensor:
        """Sum a small tensor over the ranks in place and return it."""
        self({"value": value})
        return value

    def shift_(self, mine: torch.Tensor, counts: Any, by: int) -> torch.Tensor:
        """Send ``mine`` to rank ``rank - by`` and return rank ``rank + by``'s chunk (ranks mod ``size``): an
        all-to-all where every other rank's part is empty (one call, so two ranks never wait on each other)."""
        rank, size = self.comm.rank, self.comm.size
        source, dest = (rank + by) % size, (rank - by) % size
        out = torch.empty(counts[source], dtype=mine.dtype, device=mine.device)
        sends, recvs = [0] * size, [0] * size
        sends[dest], recvs[source] = mine.numel(), out.numel()
        mine = mine.contiguous()
        options = dist.AllToAllOptions()
        self._collective(lambda: self.pg.alltoall_base(out, mine, recvs, sends, options), out, mine)
        return out

    def _collective(self, launch: Callable[[], Any], buffer: torch.Tensor, *keep: torch.Tensor) -> None:
        """Run one collective whose result lands in ``buffer``, waited on as :meth:`finish` waits for buckets."""
        if self.comm.abort.is_set():
            raise CollectiveAborted(f"rank {self.comm.rank}: collective abandoned on request (a peer failed)")
        try:
            work = launch()
        except Exception as exc:
            raise CollectiveAborted(f"rank {self.comm.rank}: {self.backend} collective failed: {exc}") from None
        self._pending.append(_Work(buffer, buffer, work, _completion(work) if self.backend != "nccl" else None))
        try:
            self.finish()
        except BaseException:
            keep_alive(*keep)
            raise

    def start(self, bucket: torch.Tensor) -> None:
        """Start summing ``bucket`` (flat, contiguous) over the ranks; returns at once."""
        if self.comm.abort.is_set():
            raise CollectiveAborted(f"rank {self.comm.rank}: collective abandoned on request (a peer failed)")
        wire = bucket.float() if self.fp32_reduce and bucket.dtype in _SIXTEEN else bucket
        try:
            work = self.pg.allreduce([wire])
        except Exception as exc:
            raise CollectiveAborted(f"rank {self.comm.rank}: {self.backend} allreduce failed: {exc}") from None
        self._pending.append(_Work(bucket, wire, work, _completion(work) if self.backend != "nccl" else None))

    def finish(self) -> None:
        """Wait for every bucket started since the last ``finish``, each written back as soon as it is summed.

        With NCCL the current stream waits for each sum (no host copy); the host then waits for the
        stream while it polls the abort flag, so that sums cut short by :meth:`abort` are never used:
        the step reads its statistics right after this anyway, before the optimizer runs."""
        try:
            for w in self._pending:
                self._wait(w)
                if w.wire is not w.bucket:
                    w.bucket.copy_(w.wire)
            if self.backend == "nccl" and self._pending:
                self._settle()
        except BaseException:
            self.abandon()
            raise
        self._pending = []

    def _settle(self) -> None:
        """NCCL: wait on the host until the current stream is past the sums, unless abort comes first."""
        done = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch.cuda.Event is unannotated
        done.record()
        spins = 0
        while not done.query():  # type: ignore[no-untyped-call]
            if self.comm.abort.is_set():
                break
            spins += 1
            if spins > 1000:
                time.sleep(50e-6)
        if self.comm.abort.is_set():  # the sums may have been cut short
            raise CollectiveAborted(f"rank {self.comm.rank}: collective abandoned on request (a peer failed)")

    def _wait(self, w: _Work) -> None:
        with self.comm.waiting():
            self._wait_done(w)

    def _wait_done(self, w: _Work) -> None:
        if w.done is not None:
            while not w.done.wait(POLL_S):
                if self.comm.abort.is_set():
                    raise CollectiveAborted(f"rank {self.comm.rank}: collective abandoned on request (a peer failed)")
        try:
            w.work.wait()  # gloo: done, raises its error if any; NCCL: the current stream waits for NCCL's
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CollectiveAborted(
                f"rank {self.comm.rank}: {self.backend} allreduce failed (a peer failed?): {first}"
            ) from None

    def abandon(self) -> None:
        """Forget the buckets in flight; they, and this process group, stay alive for the backend's threads."""
        if self._pending:
            keep_alive(self.pg, self.store, [(w.work, w.bucket, w.wire) for w in self._pending])
        self._pending = []

    def abort(self) -> None:
        """From another thread: cut short what is in flight (NCCL aborts its communicators; a gloo wait
        sees :attr:`Communicator.abort`)."""
        if self.backend == "nccl":
            keep_alive(self.pg, self.store)
            self.pg.abort()

    def close(self) -> None:
        """Release the process group (a new membership builds its own)."""
        self.abandon()
        if not self.comm.abort.is_set():  # nothing can be in flight: shut it down now
            try:
                self.pg.shutdown()
            except Exception:  # already aborted, or a backend without shutdown: dropping it is enough
                pass
        else:
            keep_alive(self.pg, self.store)
