"""``RunState``: everything one ``fit()`` run knows about its progress, as one frozen value.

The controller owns it and replaces it (``dataclasses.replace``) at each transition; nothing else
writes it.  ``step`` is the cursor (the last step completed); ``history`` holds one metrics record
per step as a persistent list (appending a chunk costs the same at step 100 as at step 100,000);
``restarts`` one :class:`RestartRecord` per recovery; ``timers`` when the last things happened.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Iterator, Optional

__all__ = ["Checkpoint", "History", "Pace", "Phase", "RestartRecord", "RunState", "StepRecord", "Timers"]

StepRecord = dict[str, Any]  # one step's metrics: "step", "epoch", "time", "world_size", the step's metrics...


class Phase(str, enum.Enum):
    """Where the controller is; logged at each change and written into restart records."""

    STARTING = "starting"  # placing, starting and joining a group
    RUNNING = "running"  # chunks of steps in flight
    DRAINING = "draining"  # no new chunks: finishing those in flight before a planned stop
    RECOVERING = "recovering"  # carrying out a decision of the failure policy
    DONE = "done"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """The newest checkpoint on storage and what a cold restart starts from: its state in driver
    memory, or (a large state rank 0 wrote itself) a ``StoredState`` naming the file and its checksum,
    which the workers read from storage."""

    step: int
    path: str | None
    state: Any


class History:
    """The step records of a run, oldest first: a persistent list of chunks.

    ``append`` returns a new history sharing the old one's records (constant time, whatever the
    length); ``until`` walks back only over the chunks it drops.  Iterating is linear.

    Example:
        >>> h = History().append([{"step": 1}, {"step": 2}]).append([{"step": 3}])
        >>> [r["step"] for r in h.until(2)], len(h), h.last["step"]
        ([1, 2], 3, 3)
    """

    __slots__ = ("_chunk", "_rest", "_length")

    def __init__(self, chunk: tuple[StepRecord, ...] = (), rest: Optional["History"] = None) -> None:
        self._chunk, self._rest = chunk, rest
        self._length = len(chunk) + (len(rest) if rest is not None else 0)

    @classmethod
    def of(cls, records: Any) -> "History":
        """A history holding ``records`` (any iterable of step records)."""
        return cls(tuple(records))

    def append(self, records: list[StepRecord] | tuple[StepRecord, ...]) -> "History":
        """This history with ``records`` (the next steps, in order) after it."""
        return History(tuple(records), self) if records else self

    def until(self, step: int) -> "History":
        """The records of steps up to and including ``step``."""
        node: History | None = self
        while node is not None and node._chunk and node._chunk[0]["step"] > step:
            node = node._rest
        if node is None:
            return History()
        if node._chunk and node._chunk[-1]["step"] > step:
            return History(tuple(r for r in node._chunk if r["step"] <= step), node._rest)
        return node

    def after(self, step: int) -> list[StepRecord]:
        """The records of the steps after ``step``, oldest first (walks back over those alone)."""
        out: list[StepRecord] = []
        node: History | None = self
        while node is not None:
            for record in reversed(node._chunk):
                if record["step"] <= step:
                    return out[::-1]
                out.append(record)
            node = node._rest
        return out[::-1]

    @property
    def last(self) -> StepRecord | None:
        """The newest record, or ``None``."""
        node: History | None = self
        while node is not None and not node._chunk:
            node = node._rest
        return node._chunk[-1] if node is not None else None

    def __len__(self) -> int:
        return self._length

    def __iter__(self) -> Iterator[StepRecord]:
        chunks, node = [], self  # type: tuple[list[tuple[StepRecord, ...]], History | None]
        while node is not None:
            chunks.append(node._chunk)
            node = node._rest
        for chunk in reversed(chunks):
            yield from chunk

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"History({len(self)} records)"


@dataclasses.dataclass(frozen=True)
class RestartRecord:
    """One recovery (or planned re-formation), as ``Result.restarts`` and the restart callbacks show it.

    Attributes:
        time: wall-clock time the failure was recorded.
        step: the last step completed when it was seen.
        kind: the :class:`~raympi.driver.policy.FailureKind`'s value.
        cause: one line.
        phase: the controller's phase when it was seen.
        ranks: the ranks that failed, where known.
        nodes: the nodes they were on, where known.
        path: ``"warm"`` (survivors kept their state) or ``"cold"`` (a new group from a checkpoint).
        world_before: ranks before it.
        world_after: ranks after it.
        restored_step: the step training continued from; ``steps_lost``: ``step - restored_step``.
        detect_s: the last completed chunk -> the failure noticed.
        reform_s: noticed -> the new group ready (carrying the decision out).
        recovery_s: noticed -> the first step completed after it (for every path, grow included).
        first_step_s: the new group ready -> its first completed step.
        spare: a hot spare took a failed rank's place.
        warm_skipped: why a warm restart was tried and given up (then ``path`` is cold).
        source: ``"survivors"`` when a cold restart started from the survivors' state, not a checkpoint.
        reformed: how a warm path made its communicator: ``"derived"`` from the standby communicator
            (no new connection) or ``"connected"`` anew.
        report: a hang's report in the run's folder: where each rank was, and its Python stacks.
    """

    time: float
    step: int
    kind: str
    cause: str
    phase: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    path: str = "cold"
    world_before: int = 0
    world_after: int | None = None
    restored_step: int | None = None
    steps_lost: int | None = None
    detect_s: float | None = None
    reform_s: float | None = None
    recovery_s: float | None = None
    first_step_s: float | None = None
    spare: bool = False
    warm_skipped: str | None = None
    source: str | None = None
    reformed: str | None = None
    report: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain values (lists, no ``None`` fields) for JSON, callbacks and ``Result.restarts``."""
        out = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out["ranks"], out["nodes"] = list(self.ranks), list(self.nodes)
        if "source" in out:
            out["from"] = out.pop("source")
        return out

    @classmethod
    def from_dict(cls, record: dict[str, Any]) -> "RestartRecord":
        """Read back what :meth:`as_dict` wrote (a manifest of an older raympi: unknown keys dropped)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in record.items() if k in known}
        if "from" in record:
            values["source"] = record["from"]
        values["ranks"], values["nodes"] = tuple(values.get("ranks", ())), tuple(values.get("nodes", ()))
        values.setdefault("time", 0.0)
        values.setdefault("step", 0)
        values.setdefault("kind", "?")
        values.setdefault("cause", "")
        values.setdefault("phase", "running")
        return cls(**values)


@dataclasses.dataclass(frozen=True)
class Timers:
    """When (``time.monotonic()``) the things the controller times last happened.

    Attributes:
        progress: the last chunk completed (or the group started).
        detected: the newest failure was noticed.
        reformed: the last recovery was carried out.
        recovering: while the newest restart record waits for its first completed step: when its
            failure was noticed; else ``None``.
    """

    progress: float = 0.0
    detected: float = 0.0
    reformed: float = 0.0
    recovering: float | None = None


@dataclasses.dataclass(frozen=True)
class Pace:
    """Notices a group that runs far slower after a warm restart than before it, as a value.

    A survivor's MPI library can be left sick by a peer that died mid-collective (seen here: MPICH
    over UCX after a node loss, every step ~15x slower, for good).  Fed each chunk's samples/s and the
    time, it learns the pace (a moving average) while no restart is being watched, and for ``watch``
    chunks after a warm restart reports the slowdown once ``chunks`` chunks in a row, over at least
    ``min_s`` seconds, ran ``factor`` times slower.  A slow streak is watched to its end: a machine
    busy for a few seconds (a node and a replacement starting on the ranks' cores made steps 9x slower
    here) is not a sick group.
    """

    rate: float | None = None  # the learned samples/s
    left: int = 0  # chunks still watched after a warm restart
    slow: int = 0  # slow chunks in a row
    slow_since: float = 0.0  # when the first of them ended
    factor: float = 5.0
    chunks: int = 3
    min_s: float = 10.0
    watch: int = 12

    def restarted(self) -> "Pace":
        """A warm restart happened: watch the chunks that follow."""
        return dataclasses.replace(self, left=self.watch, slow=0)

    def observe(self, rate: float, now: float) -> tuple["Pace", float | None]:
        """Take one chunk's samples/s, at time ``now``; returns the new value and, when the group is
        degraded, how many times slower it is."""
        if not self.left:
            learned = rate if self.rate is None else 0.8 * self.rate + 0.2 * rate
            return dataclasses.replace(self, rate=learned), None
        if not (self.rate and rate * self.factor < self.rate):
            return dataclasses.replace(self, left=self.left - 1, slow=0), None
        since = self.slow_since if self.slow else now
        if self.slow + 1 < self.chunks or now - since < self.min_s:
            return dataclasses.replace(self, slow=self.slow + 1, slow_since=since), None
        return dataclasses.replace(self, left=0, slow=self.slow + 1, slow_since=since), self.rate / max(rate, 1e-9)


@dataclasses.dataclass(frozen=True)
class RunState:
    """One run's progress.

    Attributes:
        phase: the controller's phase.
        step: the last step completed (the data cursor).
        start_step: the step the current group started from.
        history: one metrics record per completed step.
        restarts: one record per recovery (and per planned re-formation).
        failures: infrastructure failures survived so far (the ``max_restarts`` budget).
        newest: the newest checkpoint written, or ``None``.
        warm_possible: whether survivors can keep their state (not with a Ray Dataset).
        timers: when things last happened.
        pace: the steps' pace, watched after a warm restart.
    """

    phase: Phase = Phase.STARTING
    step: int = 0
    start_step: int = 0
    history: History = dataclasses.field(default_factory=History)
    restarts: tuple[RestartRecord, ...] = ()
    failures: int = 0
    newest: Checkpoint | None = None
    warm_possible: bool = True
    timers: Timers = dataclasses.field(default_factory=Timers)
    pace: Pace = dataclasses.field(default_factory=Pace)

    def until(self, step: int) -> History:
        """The history up to and including ``step``."""
        return self.history.until(step)
