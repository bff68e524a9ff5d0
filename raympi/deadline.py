"""Deadlines for every wait raympi does: one helper, so each wait ends and its error names its setting.

A :class:`Deadline` is created from the config field that bounds a wait (``startup_timeout_s``,
``step_timeout_s``, ...) and quotes it when it expires.  :func:`each_done` waits on Ray tasks one at
a time until they are all done or the deadline passes; :meth:`Deadline.backoff` paces a retry loop.
"""

from __future__ import annotations

import time
from typing import Any, Iterator, Sequence

__all__ = ["Deadline", "Expired", "each_done"]


class Expired(Exception):
    """Internal: a deadline passed while ``pending`` were still outstanding (callers turn it into a raympi error)."""

    def __init__(self, deadline: "Deadline", pending: list[Any]) -> None:
        super().__init__(f"{deadline.setting} passed with {len(pending)} task(s) pending")
        self.deadline, self.pending = deadline, pending


class Deadline:
    """A moment a wait must end by, named after the setting that chose it.

    Args:
        seconds: how long from now.
        field: the config field that set it (quoted in errors), e.g. ``"step_timeout_s"``.

    Example:
        >>> d = Deadline(2.0, "step_timeout_s")
        >>> d.setting
        'step_timeout_s=2 s'
    """

    def __init__(self, seconds: float, field: str = "timeout_s", *, start: float | None = None) -> None:
        self.seconds, self.field = seconds, field
        self.at = (time.monotonic() if start is None else start) + seconds

    @property
    def setting(self) -> str:
        """``field=seconds s``, as an error message quotes it."""
        return f"{self.field}={self.seconds:g} s"

    def remaining(self) -> float:
        """Seconds left, never negative."""
        return max(0.0, self.at - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def sooner(self, seconds: float) -> "Deadline":
        """This deadline or ``seconds`` from now, whichever comes first (same field)."""
        d = Deadline(self.seconds, self.field)
        d.at = min(self.at, time.monotonic() + seconds)
        return d

    def backoff(self, first_s: float = 0.05, most_s: float = 1.0) -> Iterator[float]:
        """Sleep between tries, doubling from ``first_s`` up to ``most_s``, until the deadline; yields seconds left."""
        pause = first_s
        while True:
            yield self.remaining()
            if self.expired():
                return
            time.sleep(min(pause, self.remaining()))
            pause = min(most_s, pause * 2)


def each_done(refs: Sequence[Any], deadline: Deadline) -> Iterator[Any]:
    """Yield Ray object refs as their tasks finish, in completion order.

    Raises:
        Expired: the deadline passed first (``.pending`` lists the refs still outstanding).
    """
    import ray

    pending = list(refs)
    while pending:
        if deadline.expired():
            raise Expired(deadline, pending)
        done, pending = ray.wait(pending, num_returns=1, timeout=deadline.remaining())
        yield from done
