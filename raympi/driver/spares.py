"""The workers a group holds beyond its ranks: hot spares and replacements, at each stage of their life.

A spare starts outside MPI (:class:`Starting`), joins the group's standby communicator between two chunks
(:class:`Joining`, then :class:`Standby`), and takes a failed rank's place at the next re-formation.  A
replacement is a worker started for a failed rank when no spare was there; it waits (:class:`Starting`)
until a re-formation takes it in.  :class:`Spares` keeps the lists; :class:`~raympi.driver.group.WorkerGroup`
decides where workers start and when they join.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import ray

__all__ = ["Joining", "Spares", "Standby", "Starting", "succeeded"]

log = logging.getLogger("raympi")


def succeeded(ref: Any) -> bool:
    """Whether a finished task succeeded (a spare that died starting did not)."""
    try:
        ray.get(ref, timeout=0)
        return True
    except ray.exceptions.RayError:
        return False


@dataclasses.dataclass
class Starting:
    """A worker outside MPI: started (``ready`` is the ref of its first call) and maybe ready."""

    actor: Any
    bundle: int | None  #: the group's bundle it holds; ``None``: outside the placement group
    ready: Any

    def done(self) -> bool:
        """Whether its first call is over (succeeded or not)."""
        return bool(ray.wait([self.ready], timeout=0)[0])

    def usable(self) -> bool:
        """Whether it started and answered."""
        return self.done() and succeeded(self.ready)


@dataclasses.dataclass
class Standby:
    """A hot spare inside the standby communicator: it takes a rank with no new connection."""

    actor: Any
    bundle: int | None


@dataclasses.dataclass
class Joining:
    """A spare's join of the standby communicator in flight: its own call first, then each member's."""

    spare: Starting
    calls: list[Any]


@dataclasses.dataclass
class Spares:
    """What a group holds beyond its ranks.

    Attributes:
        target: hot spares to keep.
        outside: hot spares outside MPI, starting or ready.
        inside: hot spares inside the standby communicator.
        joining: a spare's join in flight, if any.
        replacements: workers started for failed ranks, waiting to be taken in.
        incoming: spares from ``inside`` taking failed ranks' places at the next re-formation.
        parked: spares kept from the last fit (:mod:`raympi.driver.pool`), not yet started for this one.
        refill: bundles freed by spares taken in, for new spares once re-formed.
        used: spares taken in so far.
        next_top_up: the monotonic time of the next try to start a missing spare.
    """

    target: int = 0
    outside: list[Starting] = dataclasses.field(default_factory=list)
    inside: list[Standby] = dataclasses.field(default_factory=list)
    joining: Joining | None = None
    replacements: list[Starting] = dataclasses.field(default_factory=list)
    incoming: list[Standby] = dataclasses.field(default_factory=list)
    parked: list[Any] = dataclasses.field(default_factory=list)
    refill: list[int | None] = dataclasses.field(default_factory=list)
    used: int = 0
    next_top_up: float = 0.0

    def held(self) -> int:
        """Hot spares held now (outside, inside, or joining)."""
        return len(self.outside) + len(self.inside) + (self.joining is not None)

    def bundles(self) -> set[int | None]:
        """The group's bundles the spares hold."""
        held = {s.bundle for s in self.outside} | {s.bundle for s in self.inside}
        return held | ({self.joining.spare.bundle} if self.joining else set())

    def replacement_ready(self) -> bool:
        """Whether a replacement is ready to be taken in."""
        return bool(self.replacements) and bool(ray.wait([s.ready for s in self.replacements], timeout=0)[0])

    def take_ready_replacements(self) -> list[Starting]:
        """The replacements that finished starting, removed from the list; those that failed are killed."""
        taken = []
        for item in [s for s in self.replacements if s.done()]:
            self.replacements.remove(item)
            if succeeded(item.ready):
                taken.append(item)
            else:
                ray.kill(item.actor, no_restart=True)
        return taken

    def sorted_outside(self) -> list[Starting]:
        """The spares outside MPI still alive, ready ones first; those that died starting are killed."""
        alive, ready = list[Starting](), list[Starting]()
        for spare in self.outside:
            if spare.done() and not succeeded(spare.ready):  # died starting (its node is gone, say)
                ray.kill(spare.actor, no_restart=True)
                continue
            (ready if spare.done() else alive).append(spare)
        return ready + alive

    def settle_join(self, wait_s: float = 0.0) -> Standby | bool | None:
        """Account for the join in flight once it is over (``wait_s``: wait that long, then give up on it).

        Returns the spare now inside (also appended to ``inside``); ``True`` when the join was cut short
        after a member went through it (the members disagree on the standby communicator); ``False`` when it
        was cut short before; ``None`` when none is over.
        """
        if self.joining is None:
            return None
        spare, calls = self.joining.spare, self.joining.calls
        done, _ = ray.wait(calls, num_returns=len(calls), timeout=wait_s)
        if len(done) < len(calls) and not wait_s:
            return None  # still queued behind the chunks in flight
        self.joining = None
        answers = [ray.get(r) if succeeded(r) else None for r in done]
        if len(done) == len(calls) and all(isinstance(a, int) for a in answers):
            self.inside.append(Standby(spare.actor, spare.bundle))
            log.info("raympi: a hot spare is standby rank %d", answers[0])
            return self.inside[-1]
        log.info("raympi: a hot spare's join was cut short (answers %s of %d)", answers, len(calls))
        ray.kill(spare.actor, no_restart=True)  # blocked in its accept for good
        return any(isinstance(a, int) for r, a in zip(done, answers) if r is not calls[0])

    def actors(self) -> list[Any]:
        """Every actor held, for a shutdown."""
        starting = [s.actor for s in self.replacements + self.outside]
        inside = [s.actor for s in self.inside + self.incoming]
        return starting + inside + self.parked + ([self.joining.spare.actor] if self.joining else [])

    def clear(self) -> None:
        """Forget every actor held (after they were killed or parked)."""
        self.outside, self.inside, self.replacements, self.incoming, self.parked = [], [], [], [], []
        self.joining = None
