"""A run's timeline as a PNG: each rank's milliseconds a step computing, waiting for data and waiting in collectives,
against the step, with its restarts marked (failures, evictions, migrations, planned stops).

``fit`` writes it as ``timeline.png`` in the run's folder at its end, beside ``metrics.png``, and ``python -m raympi
report RUN_DIR`` again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from raympi.driver.report import ms_per_step
from raympi.driver.summary import category, rank_times, slowest

__all__ = ["write_timeline"]

_PANELS = (("compute_s", "compute"), ("data_s", "data"), ("collective_s", "collective"))
_COLOURS = {"failure": "tab:red", "eviction": "tab:orange", "migration": "tab:purple", "planned": "tab:gray"}
_RANKS = ("tab:blue", "tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")  # none a restart's colour
_NAMED = 8  # ranks named in the legend; in a larger world, only the slowest


def _series(lines: Sequence[Mapping[str, Any]], key: str) -> list[tuple[list[int], list[float]]]:
    """Each rank's ms a step of ``key`` at each chunk's last step, as (steps, values); a gap (NaN) where the world had
    no such rank, or where the steps went back (a cold restart or a resume runs them again)."""
    series: list[tuple[list[int], list[float]]] = []
    for i, line in enumerate(lines):
        ms = ms_per_step(line, key)
        series += [([], []) for _ in range(len(ms) - len(series))]
        back = i > 0 and line["step"] < lines[i - 1]["step"]
        for rank, (steps, values) in enumerate(series):
            if steps and (back or rank >= len(ms)) and not math.isnan(values[-1]):
                steps.append(steps[-1])
                values.append(math.nan)
            if rank < len(ms):
                steps.append(line["step"])
                values.append(ms[rank])
    return series


def write_timeline(
    lines: Sequence[Mapping[str, Any]], restarts: Sequence[Mapping[str, Any]], path: str, fs: Any
) -> None:
    """Draw the ``ranks.jsonl`` ``lines`` and the restart records ``restarts`` (as in a manifest) as a PNG at
    ``path`` of the fsspec file system ``fs``: three panels (compute, data, collective), one line per rank, the
    slowest rank by compute drawn thicker, a dashed line at each restart's step coloured by its
    :func:`~raympi.driver.summary.category`.

    Example:
        >>> import fsspec, json  # doctest: +SKIP
        >>> lines = [json.loads(line) for line in open("runs/x/ranks.jsonl")]  # doctest: +SKIP
        >>> write_timeline(lines, [], "runs/x/timeline.png", fsspec.filesystem("file"))  # doctest: +SKIP
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ranks = rank_times(lines)
    top = slowest(lines)
    slow = top[0] if top is not None else None
    fig, axes = plt.subplots(len(_PANELS), 1, figsize=(12, 8), sharex=True)
    for ax, (key, name) in zip(axes, _PANELS):
        for rank, (steps, ms) in enumerate(_series(lines, key)):
            named = rank == slow or len(ranks) <= _NAMED
            label = f"rank {rank}" + (" (slowest)" if rank == slow and len(ranks) > 1 else "")
            colour = _RANKS[rank % len(_RANKS)]
            ax.plot(steps, ms, color=colour, lw=2.0 if rank == slow else 1.0, label=label if named else None)
        for record in restarts:
            ax.axvline(record.get("step", 0), color=_COLOURS[category(str(record.get("kind")))], ls="--", lw=1)
        ax.set_ylabel(f"{name} ms a step")
        ax.grid(alpha=0.3)
    axes[-1].set_xlabel("step")
    title = f"each rank's time a step, {len(lines)} chunks"
    if top is not None:
        title += f"; slowest by compute: rank {top[0]}, {top[1]:.2f}x the median of its peers"
    axes[0].set_title(title)
    if ranks:
        axes[0].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    kinds: dict[str, set[str]] = {}
    for record in restarts:
        kinds.setdefault(category(str(record.get("kind"))), set()).add(str(record.get("kind")))
    if kinds:
        handles = [
            Line2D([], [], color=_COLOURS[what], ls="--", label=f"{what}: {', '.join(sorted(k))}")
            for what, k in sorted(kinds.items())
        ]
        axes[1].legend(
            handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", title="restarts"
        )
    fig.tight_layout()
    with fs.open(path, "wb") as f:
        fig.savefig(f, format="png", dpi=90)
    plt.close(fig)
