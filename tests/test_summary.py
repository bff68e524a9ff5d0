"""A run's folder read back (raympi.driver.summary), its timeline (raympi.driver.timeline), ``python -m raympi report``
and TensorBoard's per-rank scalars, on a synthetic run folder: ranks.jsonl with a world that shrinks, checkpoints
whose manifests hold the restart records, hang reports.  A real run's report: tests/test_run_control.py."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import fsspec
import pytest

from raympi.driver import report, summary, timeline

PNG = b"\x89PNG\r\n\x1a\n"
LOCAL = fsspec.filesystem("file")


def _line(step: int, steps: int, compute: list[float], data: float = 0.004, collective: float = 0.16) -> dict:
    world = len(compute)
    return {
        "step": step,
        "steps": steps,
        "time": 1.0e9 + step,
        "world": world,
        "data_s": [data] * world,
        "compute_s": compute,
        "collective_s": [collective] * world,
    }


# Rank 2 computes 50 ms a step for two chunks, is evicted at step 8 (a spare takes its place: 10 ms); rank 1 is lost
# at step 12 and the run goes back to step 10 on 2 ranks; then a node drain moves the group.
LINES = [
    _line(4, 4, [0.04, 0.04, 0.2]),
    _line(8, 4, [0.04, 0.04, 0.2]),
    _line(12, 4, [0.04, 0.04, 0.04]),
    _line(12, 2, [0.02, 0.02]),
    _line(16, 4, [0.04, 0.04]),
]


def _restart(step: int, kind: str, cause: str, ranks: list[int], path: str, world: tuple[int, int], **more) -> dict:
    """A restart record as a manifest holds it (RestartRecord.as_dict)."""
    before, after = world
    record = {"time": 1.0e9 + step, "step": step, "kind": kind, "cause": cause, "phase": "running", "ranks": ranks}
    return {**record, "nodes": [], "path": path, "world_before": before, "world_after": after, **more}


STRAGGLER = _restart(8, "straggler", "rank(s) [2] computed 5.0x slower", [2], "warm", (3, 3), recovery_s=0.25)
LOST = _restart(12, "worker_lost", "rank 1 died", [1], "cold", (3, 2), steps_lost=2)
DRAIN = _restart(12, "node_drain", "node n3 drains", [0, 1], "warm", (2, 2))


@pytest.fixture
def run_dir(tmp_path: pathlib.Path) -> pathlib.Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "ranks.jsonl").write_text("".join(json.dumps(line) + "\n" for line in LINES) + '{"step": 20, "ste')
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 0.5}\n')
    for step, restarts in ((8, [STRAGGLER]), (16, [STRAGGLER, LOST, DRAIN])):
        (folder / f"step-{step:08d}").mkdir()
        (folder / f"step-{step:08d}" / "manifest.json").write_text(json.dumps({"step": step, "restarts": restarts}))
    (folder / "step-00000020").mkdir()  # a manifest cut short: the newest readable one holds the records
    (folder / "step-00000020" / "manifest.json").write_text('{"step": 20, "rest')
    for name in ("hang-step-13-20260101-000000.txt", "hang-step-5-20260101-000000.txt"):
        (folder / name).write_text("rank 1 hung\n")
    return folder


def test_each_ranks_time_a_step_over_a_world_that_shrinks():
    ranks = summary.rank_times(LINES)
    assert [r.rank for r in ranks] == [0, 1, 2] and [r.chunks for r in ranks] == [5, 5, 3]
    assert ranks[0].compute_ms == pytest.approx(1e3 * 0.18 / 18) and ranks[1].compute_ms == pytest.approx(10.0)
    assert ranks[2].compute_ms == pytest.approx(1e3 * 0.44 / 12)  # 36.7 ms: its own 3 chunks, 12 steps
    assert ranks[0].data_ms == pytest.approx(1e3 * 0.02 / 18) and ranks[2].collective_ms == pytest.approx(40.0)
    assert summary.slowest(LINES) == (2, pytest.approx(0.44 / 0.12))  # against its peers' median in the same chunks
    assert summary.slowest(LINES[-1:]) == (0, pytest.approx(1.0))  # two equal ranks
    assert summary.slowest([_line(4, 4, [0.04]), _line(8, 4, [0.2])]) is None  # never any peers
    # rank 1 ran only in a first, slow chunk (all slow together): its peers' median there is the measure
    assert summary.slowest([_line(1, 1, [0.5, 0.5]), _line(9, 8, [0.04])]) == (0, pytest.approx(1.0))
    assert summary.slowest([]) is None


def test_the_kinds_of_restart():
    assert [summary.category(k) for k in ("straggler", "node_drain", "worker_lost", "hung", "collective")] == [
        "eviction",
        "migration",
        "failure",
        "failure",
        "failure",
    ]
    assert {summary.category(k) for k in ("preempted", "capacity_back", "replacement_ready", "degraded")} == {"planned"}


def test_a_run_folder_read_back(run_dir):
    run = summary.read_run(str(run_dir), LOCAL)
    assert len(run.lines) == 5  # the line cut short by a crash is left out
    assert run.checkpoint == "step-00000016" and [r["kind"] for r in run.restarts] == [
        "straggler",
        "worker_lost",
        "node_drain",
    ]
    assert run.hang_reports == ("hang-step-5-20260101-000000.txt", "hang-step-13-20260101-000000.txt")
    text = summary.format_summary(run).splitlines()
    assert text[1] == "ranks.jsonl: 5 chunks, 18 steps run (to step 16), world 3 -> 2"
    assert text[3].split() == ["0", "1.11", "10.00", "44.44", "5"]
    assert text[5].split() == ["2", "1.00", "36.67", "40.00", "3"]
    assert "slowest by compute: rank 2, 36.67 ms a step, 3.67x the median of its peers" in text
    assert "restarts: 3 (node_drain 1, straggler 1, worker_lost 1), from step-00000016/manifest.json" in text
    assert (
        "  step 8 straggler (eviction), warm, world 3 -> 3, rank(s) 2, recovered in 0.25 s: "
        "rank(s) [2] computed 5.0x slower" in text
    )
    assert "  step 12 worker_lost (failure), cold, world 3 -> 2, rank(s) 1: rank 1 died" in text
    assert "evictions: 1 (rank(s) 2 at step 8)" in text and "migrations: 1 (rank(s) 0,1 at step 12)" in text
    assert "hang reports: 2" in text and text[-1] == f"  {run_dir}/hang-step-13-20260101-000000.txt"


def test_a_folder_without_ranks_or_checkpoints(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("")
    text = summary.format_summary(summary.read_run(str(tmp_path / "run"), LOCAL))
    assert "ranks.jsonl: none (no chunk logged)" in text and "restarts: 0 (no checkpoint holds any)" in text
    assert "slowest" not in text
    (tmp_path / "run" / "ranks.jsonl").write_text(json.dumps(_line(4, 4, [0.04])) + "\n")
    text = summary.format_summary(summary.read_run(str(tmp_path / "run"), LOCAL))
    assert "slowest by compute: - (no chunk had two ranks)" in text
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="holds no run"):
        summary.read_run(str(tmp_path / "empty"), LOCAL)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        summary.read_run(str(tmp_path / "missing"), LOCAL)


@pytest.mark.parametrize("lines", [LINES, LINES[:1], []], ids=["shrinks", "one-chunk", "none"])
def test_the_timeline_is_a_png(tmp_path, lines):
    path = tmp_path / "timeline.png"
    timeline.write_timeline(lines, [STRAGGLER, LOST, DRAIN], str(path), LOCAL)
    data = path.read_bytes()
    assert data[:8] == PNG and len(data) > 1000


def test_the_command_prints_the_summary_and_writes_the_timeline(run_dir):
    done = subprocess.run(
        [sys.executable, "-m", "raympi", "report", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "slowest by compute: rank 2," in done.stdout and "evictions: 1" in done.stdout
    assert done.stdout.splitlines()[-1] == f"timeline: {run_dir}/timeline.png"
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG


def test_the_command_piped_into_a_reader_that_stops_early(run_dir):
    """``raympi report DIR | head -1``: no traceback, and the timeline is written all the same."""
    report_cmd = subprocess.Popen(
        [sys.executable, "-m", "raympi", "report", str(run_dir)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert report_cmd.stdout is not None and report_cmd.stdout.readline().startswith(b"run: ")
    report_cmd.stdout.close()  # the reader stops: the command's next writes find a broken pipe
    _, err = report_cmd.communicate(timeout=120)
    assert report_cmd.returncode == 0 and err == b"", err.decode()
    assert (run_dir / "timeline.png").read_bytes()[:8] == PNG


@pytest.mark.parametrize("where, words", [("missing", "does not exist"), ("empty", "holds no run")])
def test_the_command_without_a_run(tmp_path, where, words):
    (tmp_path / "empty").mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "raympi", "report", str(tmp_path / where)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("raympi report: ") and words in done.stderr


def test_ms_per_step():
    assert report.ms_per_step(LINES[0], "compute_s") == pytest.approx([10.0, 10.0, 50.0])


def test_tensorboard_writes_each_ranks_time(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from raympi.driver.loggers import TensorBoard

    board = TensorBoard(str(tmp_path / "tb"))
    for line in LINES:
        board.on_ranks(line)
    board.on_end([])
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"rank/{k}_ms/{r}" for k in ("data", "compute", "collective") for r in range(3)} == tags
    assert [(e.step, round(e.value, 3)) for e in events.Scalars("rank/compute_ms/2")] == [
        (4, 50.0),
        (8, 50.0),
        (12, 10.0),
    ]
    assert [e.step for e in events.Scalars("rank/compute_ms/0")] == [4, 8, 12, 12, 16]
