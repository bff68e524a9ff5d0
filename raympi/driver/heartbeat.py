"""The heartbeat: the driver pings every rank while it waits on them, and finds a silent one within a second.

Each rank answers :meth:`~raympi.worker.Worker.ping` from its own health thread, even while its step
blocks in MPI, so a rank that does not answer is stopped (SIGSTOP), frozen or cut off, whatever its
chunk's pace.  :func:`silent_ranks` is the judgement, pure and tested alone; :class:`Heartbeat` sends
the pings.  No false alarms under load: a rank is judged only against others (when every rank is
late, the driver itself or the whole machine is starved, and nobody is blamed), and the limit grows
with the slowest answers seen lately (a loaded machine answers late, a stopped rank never does).

Each answer is also the rank's count of work done (steps, evaluation batches): :meth:`Heartbeat.last_progress`
tells the driver when every rank it waits on last moved on, so ``step_timeout_s`` counts from the last
step finished rather than from the start of a chunk, and a rank that is only slow (a machine loaded many
times over) is never taken for a hung one.

A worker that is still starting (importing torch, unpickling the model) has no thread to answer a ping yet:
:func:`start_hung` judges it by how long its peers took to start instead.
"""

from __future__ import annotations

import collections
import math
import time
from typing import Any, Callable, Sequence

__all__ = ["BEAT_S", "SILENT_S", "Heartbeat", "silent_ranks", "start_hung"]

BEAT_S = 0.15  # how often every rank is pinged (one ping in flight per rank) while the driver waits
SILENT_S = 0.6  # a ping unanswered this long, while another rank answered a later one: the rank is silent
SLOW_FACTOR = 4.0  # ... or this many times the slowest answer of the last RECENT, when that is longer
RECENT = 64
# A rank still starting this many times as long as the slowest of its peers took to start, and at least this
# share of startup_timeout_s (30 s at its default), is hung: the third of 3 workers on 2 cores starts after one
# of the first two (about 2x), a loaded machine imports torch in 5-10 s, and a user whose nodes start slowly
# (a runtime_env installed on a new node) raises startup_timeout_s.  At the defaults, found well within
# restart_timeout_s.
START_FACTOR = 4.0
START_FLOOR_SHARE = 0.25


def silent_ranks(unanswered: dict[int, float], answered: dict[int, float], now: float, silent_s: float) -> list[int]:
    """The ranks whose ping, sent at ``unanswered[rank]``, has gone unanswered for ``silent_s`` while
    another rank answered a ping sent after it (``answered[rank]``: when its newest answered ping was sent)."""
    late = {r for r, sent in unanswered.items() if now - sent > silent_s}
    return sorted(
        r
        for r in late
        if any(sent > unanswered[r] for other, sent in answered.items() if other not in late and other != r)
    )


def start_hung(ready_s: Sequence[float], waited_s: float, startup_timeout_s: float) -> bool:
    """Whether the ranks still starting after ``waited_s`` are hung, given how long the ranks that have
    started took (``ready_s``, from the same moment); never while none has started."""
    floor_s = START_FLOOR_SHARE * startup_timeout_s
    return bool(ready_s) and waited_s > max(floor_s, START_FACTOR * max(ready_s))


class Heartbeat:
    """Pings ``actors`` each time :meth:`silent` is asked (one ping in flight per rank) and judges them."""

    def __init__(self, actors: Sequence[Any], clock: Callable[[], float] = time.monotonic) -> None:
        import ray

        self._ray, self.actors, self.clock = ray, list(actors), clock
        self.unanswered: dict[int, tuple[Any, float]] = {}  # rank -> (ping in flight, when it was sent)
        self.answered: dict[int, float] = {}  # rank -> when its newest answered ping was sent
        self.waits: collections.deque[float] = collections.deque(maxlen=RECENT)  # how long answers took
        self.checked = clock()  # the last look at the answers
        self.progress: dict[int, int] = {}  # rank -> the count of work done its newest answer reported
        self.advanced: dict[int, float] = {}  # rank -> when the ping that first reported that count was sent
        self._send()

    def _send(self) -> None:
        now = self.clock()
        for rank, actor in enumerate(self.actors):
            if rank not in self.unanswered:
                self.unanswered[rank] = (actor.ping.remote(), now)

    def limit(self) -> float:
        """How long a ping may go unanswered now: ``SILENT_S``, or longer on a machine answering slowly."""
        return max(SILENT_S, SLOW_FACTOR * max(self.waits, default=0.0))

    def silent(self) -> list[int]:
        """Collect the answers, ping again the ranks that answered, and return the silent ones."""
        refs = [ref for ref, _ in self.unanswered.values()]
        done = set(self._ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        now, before = self.clock(), self.checked
        self.checked = now
        for rank, (ref, sent) in list(self.unanswered.items()):
            if ref in done:  # a dead rank's ping fails: its chunk tells the driver that it died
                self.answered[rank] = sent
                self._count(rank, ref, sent)
                # It was not answered at the last look: it took at least that long (a lower bound, so the
                # time between looks, or the driver busy elsewhere, never counts against the ranks).
                self.waits.append(max(0.0, before - sent))
                del self.unanswered[rank]
        self._send()
        unanswered = {r: sent for r, (_, sent) in self.unanswered.items()}
        return silent_ranks(unanswered, self.answered, now, self.limit())

    def _count(self, rank: int, ref: Any, sent: float) -> None:
        try:
            count = self._ray.get(ref)
        except self._ray.exceptions.RayError:  # the rank died: its chunk says so
            return
        if rank in self.progress and count != self.progress[rank]:
            self.advanced[rank] = sent  # the count moved after the previous answer, at the latest by this ping
        self.progress[rank] = count

    def last_progress(self, ranks: Sequence[int]) -> float:
        """When every one of ``ranks`` had last been seen to finish work (the oldest of them), on the
        heartbeat's clock; ``-inf`` while one of them has not been seen to move on yet."""
        return min((self.advanced.get(r, -math.inf) for r in ranks), default=-math.inf)
