"""A run's folder read back: where each rank's time went, the slowest rank, the restarts (evictions and migrations
among them) and the hang reports.  ``python -m raympi report RUN_DIR`` prints it (:func:`format_summary`);
:mod:`raympi.driver.timeline` draws the same against the step.

It reads what a run leaves next to its checkpoints: ``ranks.jsonl`` (:class:`~raympi.driver.report.RankLog`), the
restart records in the newest checkpoint's manifest (each checkpoint holds every record up to it, so a finished
run's last one holds them all) and the ``hang-step-*.txt`` reports.
"""

from __future__ import annotations

import dataclasses
import json
import posixpath
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from raympi.driver.report import TIMES, read_ranks
from raympi.driver.stragglers import peer_medians

__all__ = ["RankTimes", "RunSummary", "category", "format_summary", "rank_times", "read_run", "slowest"]

_FAILURES = frozenset({"worker_lost", "hung", "collective", "formation"})
_HANG = re.compile(r"hang-step-(\d+)-.*\.txt")


def category(kind: str) -> str:
    """What a restart of this ``kind`` was: ``"eviction"`` (``straggler``: a slow rank swapped for a spare),
    ``"migration"`` (``node_drain``: off a draining node), ``"failure"`` (``worker_lost``, ``hung``, ``collective``,
    ``formation``) or ``"planned"`` (the others: preempted, capacity back, a replacement ready, a degraded group).

    Example:
        >>> [category(kind) for kind in ("straggler", "node_drain", "hung", "capacity_back")]
        ['eviction', 'migration', 'failure', 'planned']
    """
    if kind == "straggler":
        return "eviction"
    if kind == "node_drain":
        return "migration"
    return "failure" if kind in _FAILURES else "planned"


@dataclasses.dataclass(frozen=True)
class RankTimes:
    """One rank's milliseconds a step over the ``chunks`` it ran: waiting for data, computing, in collectives."""

    rank: int
    data_ms: float
    compute_ms: float
    collective_ms: float
    chunks: int


def rank_times(lines: Sequence[Mapping[str, Any]]) -> list[RankTimes]:
    """Each rank's :class:`RankTimes` over ``ranks.jsonl`` lines, its seconds over its steps.  The world may shrink
    and grow: rank ``r`` counts the lines that had a rank ``r``.

    Example:
        >>> lines = [{"steps": 2, "data_s": [0, 0], "compute_s": [0.02, 0.06], "collective_s": [0.04, 0]},
        ...          {"steps": 2, "data_s": [0], "compute_s": [0.02], "collective_s": [0]}]
        >>> [(r.rank, r.compute_ms, r.chunks) for r in rank_times(lines)]
        [(0, 10.0, 2), (1, 30.0, 1)]
    """
    seconds: list[list[float]] = []  # by rank: data, compute, collective
    steps: list[int] = []
    chunks: list[int] = []
    for line in lines:
        world, n = len(line["compute_s"]), max(1, int(line.get("steps", 1)))
        while len(seconds) < world:
            seconds.append([0.0] * len(TIMES))
            steps.append(0)
            chunks.append(0)
        for rank in range(world):
            for i, key in enumerate(TIMES):
                seconds[rank][i] += line[key][rank]
            steps[rank] += n
            chunks[rank] += 1
    out = []
    for rank, (data, compute, collective) in enumerate(seconds):
        per = 1e3 / max(1, steps[rank])
        out.append(RankTimes(rank, data * per, compute * per, collective * per, chunks[rank]))
    return out


def slowest(lines: Sequence[Mapping[str, Any]]) -> tuple[int, float] | None:
    """The rank slowest in its own compute, and how much: its compute against the median of its peers' over the
    same chunks (the straggler rule's measure, ``stragglers.peer_medians``), so that ranks of
    worlds of different sizes, or of a slow first chunk, compare fairly.  None when no chunk had two ranks.

    Example:
        >>> slowest([{"compute_s": [0.04, 0.04, 0.2]}, {"compute_s": [0.04, 0.04, 0.04]}])
        (2, 3.0)
    """
    own: dict[int, float] = {}
    peers: dict[int, float] = {}
    for line in lines:
        compute = line["compute_s"]
        if len(compute) < 2:
            continue
        for rank, (seconds, median) in enumerate(zip(compute, peer_medians(compute))):
            own[rank] = own.get(rank, 0.0) + seconds
            peers[rank] = peers.get(rank, 0.0) + median
    ratios = {rank: own[rank] / peers[rank] for rank in own if peers[rank] > 0}
    if not ratios:
        return None
    rank = max(ratios, key=lambda r: ratios[r])
    return rank, ratios[rank]


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """What a run's folder holds.

    Attributes:
        folder: the run's folder (the checkpoint folder).
        lines: the lines of ``ranks.jsonl``.
        restarts: the restart records (:meth:`~raympi.driver.run_state.RestartRecord.as_dict`), oldest first.
        checkpoint: the checkpoint whose manifest gave the restarts (None: no checkpoint).
        hang_reports: the ``hang-step-*.txt`` files' names, by step.
    """

    folder: str
    lines: tuple[dict[str, Any], ...]
    restarts: tuple[dict[str, Any], ...]
    checkpoint: str | None
    hang_reports: tuple[str, ...]


def read_run(folder: str, fs: Any) -> RunSummary:
    """Read the run in ``folder`` of the fsspec file system ``fs``.

    Raises:
        FileNotFoundError: ``folder`` does not exist, or holds neither ``ranks.jsonl``, ``metrics.jsonl`` nor a
            checkpoint.
    """
    if not fs.isdir(folder):
        raise FileNotFoundError(f"{folder} does not exist (or is not a folder)")
    names = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(folder, detail=False))
    checkpoints = [n for n in names if n.startswith("step-")]
    if not checkpoints and not {"ranks.jsonl", "metrics.jsonl"} & set(names):
        raise FileNotFoundError(
            f"{folder} holds no run: no ranks.jsonl, metrics.jsonl or step-* checkpoint (give fit's checkpoint_dir)"
        )
    newest, restarts = None, []
    for name in reversed(checkpoints):  # the newest readable manifest holds every record up to it
        manifest = _manifest(fs, posixpath.join(folder, name, "manifest.json"))
        if manifest is not None:
            newest, restarts = name, [r for r in manifest.get("restarts", []) if isinstance(r, dict)]
            break
    hangs = sorted((n for n in names if _hang_step(n) is not None), key=lambda n: (_hang_step(n), n))
    return RunSummary(
        folder=folder,
        lines=tuple(read_ranks(posixpath.join(folder, "ranks.jsonl"), fs)),
        restarts=tuple(restarts),
        checkpoint=newest,
        hang_reports=tuple(hangs),
    )


def _hang_step(name: str) -> int | None:
    """The step of a hang report's file name (``hang-step-N-TIME.txt``), None for another file."""
    match = _HANG.fullmatch(name)
    return int(match[1]) if match else None


def _manifest(fs: Any, path: str) -> dict[str, Any] | None:
    try:
        with fs.open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def format_summary(run: RunSummary) -> str:
    """The report ``python -m raympi report`` prints: one line per rank, the slowest, the restarts, the hangs."""
    out = [f"run: {run.folder}"]
    if run.lines:
        worlds = [run.lines[0]["world"]]
        worlds += [line["world"] for prev, line in zip(run.lines, run.lines[1:]) if line["world"] != prev["world"]]
        out.append(
            f"ranks.jsonl: {len(run.lines)} chunks, {sum(int(line['steps']) for line in run.lines)} steps run "
            f"(to step {run.lines[-1]['step']}), world {' -> '.join(map(str, worlds))}"
        )
        ranks = rank_times(run.lines)
        out.append("rank    data ms  compute ms  collective ms  chunks   (a step, mean)")
        out += [
            f"{r.rank:>4} {r.data_ms:>10.2f} {r.compute_ms:>11.2f} {r.collective_ms:>14.2f} {r.chunks:>7}"
            for r in ranks
        ]
        top = slowest(run.lines)
        if top is None:
            out.append("slowest by compute: - (no chunk had two ranks)")
        else:
            rank, ratio = top
            out.append(
                f"slowest by compute: rank {rank}, {ranks[rank].compute_ms:.2f} ms a step, "
                f"{ratio:.2f}x the median of its peers"
            )
    else:
        out.append("ranks.jsonl: none (no chunk logged)")
    where = f", from {run.checkpoint}/manifest.json" if run.checkpoint else " (no checkpoint holds any)"
    kinds = Counter(str(r.get("kind", "?")) for r in run.restarts)
    by_kind = " (" + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())) + ")" if kinds else ""
    out.append(f"restarts: {len(run.restarts)}{by_kind}{where}")
    out += [f"  {_restart_line(r)}" for r in run.restarts]
    for what, kind in (("evictions", "eviction"), ("migrations", "migration")):
        moved = [r for r in run.restarts if category(str(r.get("kind", ""))) == kind]
        where_ = "; ".join(f"rank(s) {_ranks(r)} at step {r.get('step', '?')}" for r in moved)
        out.append(f"{what}: {len(moved)}" + (f" ({where_})" if moved else ""))
    out.append(f"hang reports: {len(run.hang_reports)}")
    out += [f"  {posixpath.join(run.folder, name)}" for name in run.hang_reports]
    return "\n".join(out)


def _ranks(record: Mapping[str, Any]) -> str:
    return ",".join(map(str, record.get("ranks") or [])) or "-"


def _restart_line(record: Mapping[str, Any]) -> str:
    """``step 48 hung (failure), warm, world 2 -> 2, rank(s) 1, recovered in 0.41 s: <cause>``"""
    kind = str(record.get("kind", "?"))
    after = record.get("world_after", "?")
    recovery = (
        f", recovered in {record['recovery_s']:.2f} s" if isinstance(record.get("recovery_s"), (int, float)) else ""
    )
    return (
        f"step {record.get('step', '?')} {kind} ({category(kind)}), {record.get('path', '?')}, "
        f"world {record.get('world_before', '?')} -> {after}, rank(s) {_ranks(record)}{recovery}: "
        f"{record.get('cause', '')}"
    )
