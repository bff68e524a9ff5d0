"""The heartbeat: the driver pings every rank while it waits on them, and finds a silent one in about a second.

Each rank answers :meth:`~raympi.worker.Worker.ping` from its own health thread, even while its step
blocks in MPI, so a rank that does not answer is stopped (SIGSTOP), frozen or cut off, whatever its
chunk's pace.  :func:`silent_ranks` is the judgement, pure and tested alone; :class:`Heartbeat` sends
the pings.  A rank is judged only against others: when every rank is late, the driver itself (or the
whole machine) is starved, and nobody is blamed.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

__all__ = ["BEAT_S", "SILENT_S", "Heartbeat", "silent_ranks"]

BEAT_S = 0.15  # how often every rank is pinged while the driver waits on a chunk
SILENT_S = 0.75  # no sign of life for this long, while another rank answered a later ping: the rank is silent


def silent_ranks(
    unanswered: dict[int, float], answered: dict[int, float], now: float, since: float, silent_s: float = SILENT_S
) -> list[int]:
    """The silent ranks: each has a ping in flight (sent at ``unanswered[rank]``), has shown no sign of
    life for ``silent_s`` (``answered[rank]``: when its newest answered ping was sent; ``since``, when
    the watch began, for a rank that answered none yet), and another rank answered a ping sent after
    the one in flight (so the driver's pings do get through)."""
    late = {r for r in unanswered if now - answered.get(r, since) > silent_s}
    return sorted(
        r
        for r in late
        if any(sent >= unanswered[r] for other, sent in answered.items() if other not in late and other != r)
    )


class Heartbeat:
    """Pings ``actors`` (one ping in flight per rank) each time :meth:`silent` is asked, at most every ``BEAT_S``."""

    def __init__(self, actors: Sequence[Any], clock: Callable[[], float] = time.monotonic) -> None:
        import ray

        self._ray, self.actors, self.clock = ray, list(actors), clock
        self.since = clock()
        self.unanswered: dict[int, tuple[Any, float]] = {}  # rank -> (ping in flight, when it was sent)
        self.answered: dict[int, float] = {}  # rank -> when its newest answered ping was sent
        self._send()

    def _send(self) -> None:
        now = self.clock()
        for rank, actor in enumerate(self.actors):
            if rank not in self.unanswered:
                self.unanswered[rank] = (actor.ping.remote(), now)

    def silent(self) -> list[int]:
        """Collect the answers, ping again the ranks that answered, and return the silent ones."""
        refs = [ref for ref, _ in self.unanswered.values()]
        done = set(self._ray.wait(refs, num_returns=len(refs), timeout=0)[0])
        for rank, (ref, sent) in list(self.unanswered.items()):
            if ref in done:  # a dead rank's ping fails: its chunk tells the driver that it died
                self.answered[rank] = sent
                del self.unanswered[rank]
        self._send()
        unanswered = {r: sent for r, (_, sent) in self.unanswered.items()}
        return silent_ranks(unanswered, self.answered, self.clock(), self.since)
