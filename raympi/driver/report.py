"""What the user sees: a progress line, a metrics file (JSON lines) and a loss/accuracy plot."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = [
    "TIMES",
    "Announcer",
    "MetricsLog",
    "Progress",
    "RankLog",
    "ms_per_step",
    "read_metrics",
    "read_ranks",
    "write_plot",
]

#: The lists of a ``ranks.jsonl`` line (:class:`RankLog`): each rank's seconds waiting for data, computing and waiting
#: in collectives, summed over the chunk.
TIMES = ("data_s", "compute_s", "collective_s")


class Announcer:
    """Says what a slow start is doing ("starting 2 workers", "joining MPI"), one line each, with the time since the
    first.

    Quiet when ``enabled`` is False (``progress=False``), except for :meth:`warn`.
    """

    def __init__(self, enabled: bool | None, stream: TextIO | None = None) -> None:
        self.quiet = enabled is False
        self.stream = stream or sys.stderr
        self.start = time.monotonic()

    def __call__(self, text: str) -> None:
        if not self.quiet:
            self._write(text)

    def warn(self, text: str) -> None:
        """A one-line warning the user must see: written even with ``progress=False``."""
        self._write(f"warning: {text}")

    def _write(self, text: str) -> None:
        self.stream.write(f"raympi: [{time.monotonic() - self.start:5.1f} s] {text}\n")
        self.stream.flush()


class Progress:
    """A live progress bar on a terminal, plain log lines every ``every_s`` seconds otherwise."""

    def __init__(
        self, total_steps: int, enabled: bool | None, stream: TextIO | None = None, every_s: float = 5.0
    ) -> None:
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty() if enabled is None else enabled and self.stream.isatty()
        self.quiet = enabled is False
        self.total = total_steps
        self.every_s = every_s
        self.start = time.monotonic()
        self.last = 0.0

    def update(self, step: int, record: dict[str, Any], force: bool = False) -> None:
        if self.quiet:
            return
        now = time.monotonic()
        if not (self.tty or force or now - self.last >= self.every_s):
            return
        self.last = now
        rate = record.get("samples_per_s", 0.0)
        done = step / max(1, self.total)
        steps_per_s = step / max(1e-9, now - self.start)
        eta = (self.total - step) / steps_per_s if steps_per_s > 0 and step else float("nan")
        acc = f" acc {record['accuracy']:.3f}" if "accuracy" in record else ""
        ev = f" eval_acc {record['eval_accuracy']:.3f}" if "eval_accuracy" in record else ""
        text = (
            f"step {step}/{self.total} epoch {record.get('epoch', 0) + 1} loss {record.get('loss', float('nan')):.4f}"
            f"{acc}{ev} {rate:,.0f} samples/s ETA {_clock(eta)}"
        )
        if self.tty:
            bar = "#" * int(20 * done)
            self.stream.write(f"\r[{bar:<20}] {text}\x1b[K")
        else:
            self.stream.write(f"raympi: {text}\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    if seconds != seconds:  # NaN: not known yet
        return "--:--"
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m:02d}:{s:02d}"


def write_plot(history: list[dict[str, Any]], path: str, fs: Any) -> None:
    """Loss and accuracy against step, training and eval, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax, label in (
        ("loss", ax_loss, "train loss"),
        ("eval_loss", ax_loss, "eval loss"),
        ("accuracy", ax_acc, "train accuracy"),
        ("eval_accuracy", ax_acc, "eval accuracy"),
    ):
        points = [(r["step"], r[key]) for r in history if key in r]
        if points:
            ax.plot(*zip(*points), label=label, marker="o" if key.startswith("eval") else None)
    for ax, title in ((ax_loss, "loss"), (ax_acc, "accuracy")):
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.tight_layout()
    with fs.open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=90)
    plt.close(fig)


class MetricsLog:
    """``metrics.jsonl``: one JSON line per step, appended, never rewritten.

    ``append(history)`` writes the records of steps after the last one written.  A step run again
    after a restart (the steps past the checkpoint a cold restart went back to) appears again,
    further down: the last line of a step is the one the run kept (:func:`read_metrics` reads it so).
    A filesystem that cannot append (an object store) gets the whole file rewritten instead.
    """

    def __init__(self, path: str, fs: Any, written: int = 0) -> None:
        self.path, self.fs, self.written = path, fs, written

    def append(self, history: Any) -> None:
        """Write the records of ``history`` (a :class:`~raympi.driver.run_state.History`) after the last step
        written."""
        new = history.after(self.written)
        if not new:
            return
        text = "".join(json.dumps(r) + "\n" for r in new).encode()
        try:
            with self.fs.open(self.path, "ab") as f:
                f.write(text)
        except (NotImplementedError, ValueError, OSError):  # no append on this filesystem
            with self.fs.open(self.path, "wb") as f:
                f.write("".join(json.dumps(r) + "\n" for r in history).encode())
        self.written = new[-1]["step"]

    def rewind(self, step: int) -> None:
        """Training went back to ``step`` (a restart): the steps after it will be written again when redone."""
        self.written = min(self.written, step)


class RankLog:
    """``ranks.jsonl``: one JSON line per chunk of steps with where each rank's time went, appended, never rewritten.

    A line: ``{"step": last step, "steps": steps in the chunk, "time": wall-clock, "world": ranks, "data_s": [...],
    "compute_s": [...], "collective_s": [...]}``, the lists in rank order, seconds summed over the chunk.  It logs
    what ran: steps run again after a cold restart (or a resume) appear again, with their later time.
    """

    def __init__(self, path: str, fs: Any) -> None:
        self.path, self.fs = path, fs

    def append(self, chunk: Any, world: int) -> dict[str, Any]:
        """Log ``chunk`` (a :class:`~raympi.driver.pipeline.Chunk` with its ``times``) of a group of ``world``;
        returns the line written."""
        times = chunk.times
        line = {
            "step": chunk.last,
            "steps": chunk.last - chunk.first,
            "time": round(time.time(), 3),
            "world": world,
            **{k: [round(getattr(t, k), 5) for t in times] for k in TIMES},
        }
        try:
            with self.fs.open(self.path, "ab") as f:
                f.write((json.dumps(line) + "\n").encode())
        except (NotImplementedError, ValueError, OSError):  # no append on this filesystem: the lines so far, then it
            previous = read_ranks(self.path, self.fs)
            with self.fs.open(self.path, "wb") as f:
                f.write("".join(json.dumps(r) + "\n" for r in [*previous, line]).encode())
        return line


def read_ranks(path: str, fs: Any) -> list[dict[str, Any]]:
    """The lines of ``ranks.jsonl`` (:class:`RankLog`); [] when there is none.  A line cut short by a crash
    mid-write is left out."""
    try:
        with fs.open(path, "rb") as f:
            text = f.read().decode()
    except (FileNotFoundError, OSError):
        return []
    lines = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and all(isinstance(record.get(key), list) for key in TIMES)
        ):
            lines.append(record)
    return lines


def ms_per_step(line: Mapping[str, Any], key: str) -> list[float]:
    """Each rank's milliseconds a step of ``key`` (one of :data:`TIMES`) in a ``ranks.jsonl`` line, in rank order.

    Example:
        >>> ms_per_step({"steps": 4, "compute_s": [0.04, 0.2]}, "compute_s")
        [10.0, 50.0]
    """
    steps = max(1, int(line.get("steps", 1)))
    return [1e3 * seconds / steps for seconds in line[key]]


def read_metrics(path: str, fs: Any, until: int) -> list[dict[str, Any]]:
    """The records of steps 1..``until`` in ``metrics.jsonl`` (a step's last line wins); [] when there is none."""
    try:
        with fs.open(path, "rb") as f:
            lines = f.read().decode().splitlines()
    except (FileNotFoundError, OSError):
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # a line cut short by a crash mid-write
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= until:
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
