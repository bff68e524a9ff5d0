"""Stragglers: a rank whose own work is persistently slower than its peers', judged chunk by chunk.

Every chunk, each rank reports where its time went (:class:`~raympi.worker.results.StepTimes`): waiting for
data, computing, and waiting in collectives.  In a synchronous step every rank takes as long as the slowest,
so the step's length says nothing about who is slow; a rank's *compute* time does: the slow rank computes
while its peers wait in the collective.  The rules, in :func:`slow_ranks`:

- a rank is slow when its compute time per step is at least ``factor`` times the median of its peers'
  and longer by at least ``min_step_s`` (noise on tiny steps is never a straggler);
- a whole machine (or cluster) slowed down slows every rank alike: the median moves with them, none is slow;
- a rank slow because its data is slow (its ``data_s`` is what grew, not its compute) is reported, never
  evicted: a new process would read the same data the same way;
- a slow node slows every rank on it: each is slow against the median of its peers while fewer than half
  of the ranks are on that node (more, and that median is theirs: nobody is singled out); and a spare on
  that node never takes a slow rank's place (:meth:`raympi.driver.group.WorkerGroup.replace`).

:class:`StragglerWatch` keeps the count of consecutive slow chunks per rank; a rank slow for ``chunks``
chunks in a row is a straggler, to be swapped for a hot spare through the warm path.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Sequence

from raympi.worker.results import StepTimes

__all__ = ["StragglerRule", "StragglerWatch", "peer_medians", "slow_ranks"]


@dataclasses.dataclass(frozen=True)
class StragglerRule:
    """When a rank is a straggler.

    Attributes:
        factor: its compute time per step at least this many times the median of its peers'...
        chunks: ... for this many chunks in a row.
        min_step_s: and longer than that median by at least this much per step.
    """

    factor: float = 3.0
    chunks: int = 4
    min_step_s: float = 0.01


def peer_medians(values: Sequence[float]) -> list[float]:
    """For each rank, the median of the other ranks' ``values``: what its own value is judged against."""
    return [statistics.median([*values[:r], *values[r + 1 :]]) for r in range(len(values))]


def slow_ranks(times: Sequence[StepTimes], steps: int, rule: StragglerRule) -> tuple[list[int], list[int]]:
    """``(compute-slow, data-slow)``: the ranks of one chunk of ``steps`` steps slow in their own compute,
    and those slow in waiting for their data (see the module docstring)."""
    if len(times) < 2 or steps < 1:
        return [], []

    def slow(values: list[float]) -> list[int]:
        peers = peer_medians(values)
        return [r for r, v in enumerate(values) if v >= rule.factor * peers[r] and v - peers[r] >= rule.min_step_s]

    return slow([t.compute_s / steps for t in times]), slow([t.data_s / steps for t in times])


class StragglerWatch:
    """Counts each rank's slow chunks in a row (:func:`slow_ranks`) for one group; a new group starts afresh."""

    def __init__(self, rule: StragglerRule) -> None:
        self.rule = rule
        self.streak: dict[int, int] = {}
        self.world = 0

    def observe(self, times: Sequence[StepTimes], steps: int) -> tuple[list[int], list[int]]:
        """``(stragglers, data-slow)`` after this chunk: the ranks slow in compute for ``rule.chunks`` chunks in a
        row, and those slow waiting for data in this one."""
        if len(times) != self.world:  # a new group: ranks are numbered anew
            self.streak, self.world = {}, len(times)
        compute, data = slow_ranks(times, steps, self.rule)
        self.streak = {r: self.streak.get(r, 0) + 1 for r in compute}
        return sorted(r for r, n in self.streak.items() if n >= self.rule.chunks), data

    def reset(self) -> None:
        """Forget the streaks (the group was re-formed)."""
        self.streak, self.world = {}, 0
