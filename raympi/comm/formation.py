"""Layer 2: forming one MPI communicator out of Ray actors, closed by a collective agreement.

Ray actors are MPI "singletons" (no ``mpiexec``), so they are joined with MPI's dynamic process
management: the actors start as groups of one and adjacent groups merge pairwise (``Open_port`` /
``Accept`` / ``Connect`` / ``Intercomm.Merge``), so N actors need ceil(log2 N) rounds.  Group ``i``
always merges as the low half with group ``i + 1``, so the actor given at position k is rank k.
Formation ends with an agreement: every member tells all the others whether its own joins went
right, and either every member gets a :class:`~raympi.comm.Communicator` or every member raises.

Use it in two halves::

    @ray.remote
    class Peer(raympi.comm.Member): ...

    peers = [Peer.remote() for _ in range(4)]
    raympi.comm.form(peers, timeout_s=60)      # on the driver
    # inside each actor: self.comm is a Communicator

A blocking ``MPI_Comm_accept`` cannot be cancelled, so when formation fails (a member dies, the
agreement fails, or someone misses the deadline) every member is killed: no actor is left blocked,
and the caller gets a :class:`FormationError`.

Recovery without connecting: every member also keeps the merged communicator as its *standby*
communicator, and the communicator it trains on is a duplicate of it.  A hot spare joins the standby
communicator ahead of need (:meth:`Member.mpi_join_standby`, one connect round); after a failure,
:func:`derive` makes the new training communicator out of the standby one with
``MPI_Comm_create_group``, which is collective over the new group only, so the dead never take part
and no new connection is opened (10-20 ms for 4 members: benchmarks/RESULTS.md, "Recovery without connecting").
"""

from __future__ import annotations

import socket
from typing import Any, Sequence, cast

from raympi.comm import library
from raympi.comm.communicator import DEFAULT_BUCKET_BYTES, Communicator, keep_alive
from raympi.deadline import Deadline, Expired, each_done
from raympi.exceptions import ConfigError, FormationError, where

__all__ = ["Member", "derive", "form"]

# Tags of MPI_Comm_create_group: the new standby communicator, then the training one.
_STANDBY_TAG, _TRAINING_TAG = 21, 22


class Member:
    """Mixin for a Ray actor class whose instances can join one communicator.

    After :func:`form` returns, ``self.comm`` is this rank's :class:`Communicator`.
    The ``mpi_*`` methods are called by :func:`form`, not by users.
    """

    comm: Communicator | None = None
    # Everyone of the last formation or derivation, hot spares included (an mpi4py Intracomm).
    standby: Any = None
    # This formation so far: the group merged into, the merge rounds gone through, the first local fault.
    _forming: Any = None
    _joins: int = 0
    _join_fault: str | None = None

    def mpi_open_port(self) -> str:
        """Open a port for the group this actor leads to accept on."""
        return cast(str, library.init().Open_port())

    def mpi_join(self, port: str, accept: bool) -> int:
        """Merge this actor's group with another: ``accept`` is the low half, else the high half."""
        MPI = library.init()
        current = self._forming or MPI.COMM_SELF
        inter = current.Accept(port, root=0) if accept else current.Connect(port, root=0)
        merged = inter.Merge(high=not accept)
        self._forming, self._joins = merged, self._joins + 1
        try:
            self._release(MPI, port, accept, current, inter)
        except Exception as exc:
            # The peers already hold the merged group and go on with it: raising here would leave them
            # blocked in the next round.  The fault is told to every member at the closing agreement.
            self._join_fault = self._join_fault or f"merge round {self._joins}: {type(exc).__name__}: {exc}"
        return cast(int, merged.Get_rank())

    def _release(self, MPI: Any, port: str, accept: bool, current: Any, inter: Any) -> None:
        """Close the port and free the communicators a merge leaves behind."""
        if accept and current.Get_rank() == 0:
            MPI.Close_port(port)
        inter.Free()
        if current is not MPI.COMM_SELF:
            current.Free()

    def mpi_finish(
        self, rank: int, size: int, joins: int, bucket_bytes: int = DEFAULT_BUCKET_BYTES, compression: str | None = None
    ) -> tuple[int, int, str]:
        """Close formation with a collective agreement; returns (rank, size, host).

        Each member contributes whether its own formation went right: no merge round it went through
        faulted, it went through the ``joins`` rounds :func:`form` asked of it, and it is ``rank`` of
        ``size``.  Every member learns every verdict, so either all of them raise :class:`FormationError`
        (naming the members at fault) or all of them keep the new communicator.
        """
        MPI = library.init()
        comm = self._forming or MPI.COMM_SELF.Dup()
        fault, host = self._join_fault, socket.gethostname()
        if fault is None and self._joins != joins:
            fault = f"went through {self._joins} merge round(s), asked for {joins}"
        if fault is None and (comm.Get_rank(), comm.Get_size()) != (rank, size):
            fault = f"ended as rank {comm.Get_rank()} of {comm.Get_size()}"
        self._forming, self._joins, self._join_fault = None, 0, None
        verdicts = comm.allgather((rank, host, fault))
        faults = [f"{where(r, size, h)}: {f}" for r, h, f in verdicts if f]
        if faults:
            comm.Free()
            raise FormationError(f"the closing agreement of {size} ranks failed: {'; '.join(faults)}")
        self._adopt(comm.Dup(), bucket_bytes, compression)
        if self.standby is not None:
            keep_alive(self.standby)  # the previous group's: it may hold a dead process
        self.standby = comm
        return self.comm.rank, self.comm.size, host  # type: ignore[union-attr]

    def _adopt(self, training: Any, bucket_bytes: int, compression: str | None) -> None:
        """Train on ``training`` from now on (a :class:`Communicator` over it); release the previous one."""
        if self.comm is not None and not self.comm.abort.is_set():
            self.comm.free()  # an abandoned one may still hold a collective with a dead peer: leave it
        self.comm = Communicator(training, bucket_bytes, compression) if training is not None else None

    def mpi_join_standby(self, port: str, accept: bool) -> int | None:
        """Grow the standby communicator by one process: the joining process (``accept``, from its own
        group of one) accepts on ``port``, every standby member connects to it; returns the new standby rank.

        A member whose training communicator was abandoned (a peer failed before this call came up)
        skips the join and returns None: the standby communicator holds the failed peer, so the collective
        connect would never complete.
        """
        MPI = library.init()
        if not accept and self.comm is not None and self.comm.abort.is_set():
            return None
        current = MPI.COMM_SELF if accept else self.standby
        inter = current.Accept(port, root=0) if accept else current.Connect(port, root=0)
        merged = inter.Merge(high=accept)
        merged.Set_errhandler(MPI.ERRORS_RETURN)
        if accept:
            MPI.Close_port(port)
        inter.Free()
        if self.standby is not None and not accept:
            self.standby.Free()
        elif self.standby is not None:
            keep_alive(self.standby)  # a spare's standby of an earlier group: its peers may be dead
        self.standby = merged
        return cast(int, merged.Get_rank())

    def mpi_derive(
        self,
        alive: list[int],
        members: list[int],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        compression: str | None = None,
    ) -> tuple[int, int, str] | None:
        """Keep the standby ranks ``alive`` as the new standby communicator, and train on its ranks
        ``members`` (in that order); returns (rank, size, host), or None for a standby rank left out.

        Both are ``MPI_Comm_create_group``: collective over the new group only, no connection opened.
        """
        MPI = library.init()
        standby = self.standby
        if list(alive) != list(range(standby.Get_size())):
            standby = standby.Create_group(standby.Get_group().Incl(list(alive)), tag=_STANDBY_TAG)
            standby.Set_errhandler(MPI.ERRORS_RETURN)
            keep_alive(self.standby)  # it holds a dead process: never handed to MPI again
            self.standby = standby
        if standby.Get_rank() not in members:
            self._adopt(None, bucket_bytes, compression)
            return None
        training = standby.Create_group(standby.Get_group().Incl(list(members)), tag=_TRAINING_TAG)
        training.Set_errhandler(MPI.ERRORS_RETURN)
        self._adopt(training, bucket_bytes, compression)
        return self.comm.rank, self.comm.size, socket.gethostname()  # type: ignore[union-attr]


def form(
    actors: Sequence[Any],
    *,
    timeout_s: float = 60.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    compression: str | None = None,
) -> list[tuple[int, int, str]]:
    """Join Ray actors (instances of a :class:`Member` subclass) into one MPI communicator.

    Args:
        actors: the actor handles; ``actors[k]`` becomes rank ``k``.
        timeout_s: the deadline for the whole formation.
        bucket_bytes: bucket size of the resulting communicators' allreduce.
        compression: ``"bf16"`` or ``"fp16"`` to send float32 tensors as 16-bit floats in
            :meth:`Communicator.allreduce_`; ``None`` (default) sends them as they are.

    Returns:
        ``(rank, size, host)`` of every member, in rank order.

    Raises:
        ConfigError: no actors, or a bad ``timeout_s``.
        FormationError: the MPI library is unusable, a member died or raised, the closing agreement
            failed, or the deadline passed; every member has been killed.

    Example:
        >>> form([Peer.remote() for _ in range(4)], timeout_s=30)  # doctest: +SKIP
    """
    import ray

    if len(actors) < 1:
        raise ConfigError(f"a communicator needs at least one actor, got {len(actors)}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be positive, got {timeout_s}")
    reason = library.problem()
    if reason:
        raise FormationError(reason)
    deadline = Deadline(timeout_s, "timeout_s")
    size = len(actors)
    try:
        joins = [0] * size
        groups = [[rank] for rank in range(size)]
        while len(groups) > 1:
            pairs = [(groups[i], groups[i + 1]) for i in range(0, len(groups) - 1, 2)]
            ports = _results(
                ray, size, {left[0]: actors[left[0]].mpi_open_port.remote() for left, _ in pairs}, deadline
            )
            calls = {}
            for (left, right), port in zip(pairs, ports):
                calls.update({r: actors[r].mpi_join.remote(port, True) for r in left})
                calls.update({r: actors[r].mpi_join.remote(port, False) for r in right})
            for r in calls:
                joins[r] += 1
            _results(ray, size, calls, deadline)
            groups = [left + right for left, right in pairs] + ([groups[-1]] if len(groups) % 2 else [])
        finish = {r: a.mpi_finish.remote(r, size, joins[r], bucket_bytes, compression) for r, a in enumerate(actors)}
        return _results(ray, size, finish, deadline)
    except BaseException:
        for a in actors:
            ray.kill(a, no_restart=True)
        raise


def derive(
    standby: Sequence[Any],
    alive: Sequence[int],
    members: Sequence[int],
    *,
    timeout_s: float = 10.0,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    compression: str | None = None,
) -> list[tuple[int, int, str]]:
    """A new training communicator out of the standby one, with no new connection.

    Args:
        standby: the actors of the standby communicator, in its rank order (the dead ones too).
        alive: the standby ranks that stay (the dead ones never take part).
        members: the positions in ``alive`` that train, in their new rank order.
        timeout_s: the deadline.

    Returns:
        ``(rank, size, host)`` of every member, in rank order.

    Raises:
        FormationError: a member died, raised, or missed the deadline; every live actor was killed.
    """
    import ray

    if not members or len(set(members)) != len(members) or not set(members) <= set(range(len(alive))):
        raise ConfigError(f"members must be distinct positions in alive (0..{len(alive) - 1}), got {list(members)}")
    deadline = Deadline(timeout_s, "timeout_s")
    keep = [standby[r] for r in alive]
    try:
        calls = {
            i: a.mpi_derive.remote(list(alive), list(members), bucket_bytes, compression) for i, a in enumerate(keep)
        }
        results = _results(ray, len(keep), calls, deadline)
    except BaseException:
        for a in keep:
            ray.kill(a, no_restart=True)
        raise
    return [results[i] for i in members]


def _results(ray: Any, size: int, calls: dict[int, Any], deadline: Deadline) -> list[Any]:
    """Results of ``calls`` (rank -> object ref), in order; fails fast on the first error and at the deadline."""
    rank_of = {ref: rank for rank, ref in calls.items()}
    try:
        for ref in each_done(list(rank_of), deadline):
            try:
                ray.get(ref)
            except Exception as exc:  # an actor died or raised: no point waiting for the others
                cause = exc.cause if isinstance(exc, ray.exceptions.RayTaskError) else exc
                text = str(cause).strip()
                raise FormationError(
                    f"MPI communicator of {size} actors failed at {where(rank_of[ref], size)}: "
                    f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}; every member was killed"
                ) from None
    except Expired as expired:
        blocked = sorted(rank_of[ref] for ref in expired.pending)
        raise FormationError(
            f"MPI communicator of {size} actors not formed within {deadline.setting}: rank(s) {blocked} "
            f"still blocked (a member is hung or unreachable); every member was killed"
        ) from None
    return cast(list[Any], ray.get(list(rank_of)))
