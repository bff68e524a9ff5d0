"""The controller and the recovery actions, driven with no Ray: a fake group and a scripted pipeline.

What the live tests (test_elastic, test_chaos) cannot show cheaply: the records, the append-only
metrics log, the manifests without history, and every decision taken by the policy.
"""

from __future__ import annotations

import json
import time

import pytest

from fakes import FakeGroup, ScriptedPipeline, failing_group
from raympi.driver.group import LOST
from raympi.driver.spares import Spares, Starting
from raympi.worker.results import ChunkResult
from raympi.driver.pipeline import Chunk
from raympi.driver.checkpoint import CheckpointStore
from raympi.driver.config import parse_config
from raympi.driver.controller import Controller
from raympi.driver.pipeline import ChunkPlan
from raympi.driver.policy import Failed, Failure, FailureKind
from raympi.driver.report import MetricsLog, read_metrics
from raympi.driver.run_state import History, RunState
from raympi.exceptions import CapacityError, TrainingError


def _controller(tmp_path, pipeline, capacity=lambda bundle: 3, new_group=FakeGroup, **options):
    cfg = parse_config(workers=3, min_workers=2, batch_size=24, restart_timeout_s=0.5, **options)
    store = CheckpointStore(str(tmp_path), keep=2)
    return Controller(
        cfg,
        spec=type("Spec", (), {"device": "cpu"})(),
        pipeline=pipeline,
        store=store,
        run=RunState(),
        new_group=new_group,
        capacity=capacity,
    ), store


def _lines(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_run_to_the_end_logs_every_step_once_and_manifests_carry_no_history(tmp_path):
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    controller, store = _controller(tmp_path, ScriptedPipeline(plan))
    run = controller.fit()
    store.close()
    assert run.step == 30 and [r["step"] for r in run.history] == list(range(1, 31))
    assert [r["step"] for r in _lines(tmp_path)] == list(range(1, 31))  # appended at 10, 20, 30: each step once
    manifest = json.loads((tmp_path / "step-00000030" / "manifest.json").read_text())
    assert (
        "history" not in manifest
        and manifest["metrics"]["step"] == 30
        and manifest["cursor"] == {"epoch": 3, "step_in_epoch": 0}
    )
    assert run.restarts == () and run.phase.value == "done"


def test_a_cold_restart_goes_back_to_the_checkpoint_and_logs_the_redone_steps_again(tmp_path):
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={25: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    controller, store = _controller(tmp_path, pipeline)
    run = controller.fit()
    store.close()
    assert pipeline.starts == [0, 20]  # restored from the checkpoint of step 20
    (record,) = run.restarts
    assert (record.kind, record.path, record.restored_step, record.steps_lost, record.world_after) == (
        "collective",
        "cold",
        20,
        5,
        3,
    )
    assert record.recovery_s is not None and record.recovery_s >= record.reform_s >= 0 and record.first_step_s >= 0
    assert [r["step"] for r in run.history] == list(range(1, 31))  # the trajectory: each step once
    logged = [r["step"] for r in _lines(tmp_path)]
    assert logged == list(range(1, 31))  # steps 21-25 were never logged before the failure (no checkpoint after 20)
    assert run.failures == 1 and FakeGroup.made[-1].world == 3


@pytest.mark.parametrize(
    "at_start, later, spares",
    [(4, 3, 1), (3, 4, 0)],
    ids=["room-at-start-none-at-the-restart", "no-room-at-start"],
)
def test_every_group_keeps_the_hot_spare_decided_when_the_run_started(tmp_path, at_start, later, spares):
    """Room for a spare at the start and none counted at the cold restart (the dead workers' resources
    not yet released): the new group still keeps one, to start once there is room.  No room at the
    start: none, whatever a restart counts."""
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={25: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    capacity = iter([at_start] + [later] * 1000)
    controller, store = _controller(tmp_path, pipeline, capacity=lambda bundle: next(capacity))
    FakeGroup.made.clear()
    controller.fit()
    store.close()
    assert [(g.world, g.options["spares"]) for g in FakeGroup.made] == [(3, spares), (3, spares)]


@pytest.mark.parametrize("keep", [True, False])
def test_only_the_group_of_a_run_that_ended_well_is_parked_and_only_with_keep_workers(tmp_path, keep):
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={25: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    controller, store = _controller(tmp_path, pipeline, keep_workers=keep)
    FakeGroup.made.clear()
    controller.fit()
    store.close()
    assert [(g.closed, g.parked) for g in FakeGroup.made] == [(True, False), (True, keep)]


def test_no_capacity_after_a_failure_is_the_policys_capacity_error(tmp_path):
    plan = ChunkPlan(total=20, steps_per_epoch=10, checkpoint_every=10)
    capacity = iter([1] * 1000)  # one worker's worth after the failure (the start asks none)
    pipeline = ScriptedPipeline(plan, failures={12: Failure(FailureKind.WORKER_LOST, "node lost", ranks=(1, 2))})
    controller, store = _controller(tmp_path, pipeline, capacity=lambda bundle: next(capacity))
    with pytest.raises(CapacityError, match="can host 1 worker.*fewer than min_workers=2"):
        controller.fit()
    store.close()
    assert controller.run.phase.value == "failed"


def test_a_user_error_while_restarting_stops_the_run(tmp_path):
    plan = ChunkPlan(total=20, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, failures={12: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    error = TrainingError("setting up the workers: rank 0 of 3 raised ValueError: bad")
    controller, store = _controller(tmp_path, pipeline)
    controller.make_group = failing_group(Failure(FailureKind.USER_ERROR, "bad", ranks=(0,), error=error))
    with pytest.raises(TrainingError, match="raised ValueError: bad"):
        controller.fit()
    store.close()


def _hangs_from(first_hung: int, last_hung: int):
    """A group factory whose starts number ``first_hung`` to ``last_hung`` (from 1) fail as a worker hung while
    starting does: found after restart_timeout_s (0.5 s here) has passed."""
    starts: list[int] = []

    def make(*args, **kwargs):
        starts.append(len(starts) + 1)
        if first_hung <= starts[-1] <= last_hung:
            time.sleep(0.6)
            raise Failed(Failure(FailureKind.HUNG, "starting the workers: rank(s) [1] still starting", ranks=(1,)))
        return FakeGroup(*args, **kwargs)

    return make, starts


def test_a_restart_whose_start_hung_past_the_restart_deadline_gets_one_try_more(tmp_path):
    """restart_timeout_s bounds the wait for room: a try that ran past it and failed in a worker, with room
    for the group, is tried once more (a chaos run lost its cold restart there)."""
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={25: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    make, starts = _hangs_from(2, 2)
    controller, store = _controller(tmp_path, pipeline, new_group=make)
    run = controller.fit()
    store.close()
    assert starts == [1, 2, 3] and [(r.path, r.restored_step) for r in run.restarts] == [("cold", 20)]
    assert run.step == 30


def test_a_restart_whose_every_start_hangs_gives_up_after_one_try_past_the_deadline(tmp_path):
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={25: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    make, starts = _hangs_from(2, 99)
    controller, store = _controller(tmp_path, pipeline, new_group=make)
    with pytest.raises(CapacityError, match=r"kept failing \(last: starting the workers: rank\(s\) \[1\] still"):
        controller.fit()
    store.close()
    assert starts == [1, 2, 3]


def test_a_restart_whose_tries_fail_at_once_takes_no_try_past_the_deadline_but_the_last_look(tmp_path):
    """Tries that fail quickly never overran the deadline: no try more, only the backoff's last look at it."""
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={25: Failure(FailureKind.COLLECTIVE, "a collective failed")})
    tried: list[float] = []

    def fails_at_once(*args, **kwargs):
        tried.append(time.monotonic())
        if len(tried) == 1:
            return FakeGroup(*args, **kwargs)
        raise Failed(Failure(FailureKind.FORMATION, "formation failed", ranks=()))

    controller, store = _controller(tmp_path, pipeline, new_group=fails_at_once)
    with pytest.raises(CapacityError, match="kept failing"):
        controller.fit()
    store.close()
    restart = tried[1:]
    assert len(restart) > 2 and len([t for t in restart if t > restart[0] + 0.5]) <= 1, restart


def test_a_run_resumed_from_metrics_jsonl(tmp_path):
    """A resume reads the history it needs from metrics.jsonl, the last line of a step winning."""
    log = MetricsLog(str(tmp_path / "metrics.jsonl"), CheckpointStore(str(tmp_path)).fs)
    history = History().append([{"step": s, "loss": 1.0} for s in range(1, 11)])
    log.append(history)
    log.rewind(6)  # a cold restart went back to step 6: steps 7-10 are redone
    log.append(history.until(6).append([{"step": s, "loss": 2.0} for s in range(7, 9)]))
    rows = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [*range(1, 11), 7, 8]  # appended, never rewritten
    read = read_metrics(str(tmp_path / "metrics.jsonl"), log.fs, until=8)
    assert [r["step"] for r in read] == list(range(1, 9)) and [r["loss"] for r in read][6:] == [2.0, 2.0]


def test_history_appends_in_constant_time_and_truncates():
    h = History()
    for s in range(1, 1001, 10):
        h = h.append([{"step": k} for k in range(s, s + 10)])
    assert len(h) == 1000 and h.last["step"] == 1000
    assert [r["step"] for r in h.until(995)][-3:] == [993, 994, 995] and len(h.until(995)) == 995
    assert [r["step"] for r in h.after(997)] == [998, 999, 1000] and len(h.until(0)) == 0
    assert len(h) == 1000  # persistent: the old one is untouched


def test_a_checkpoint_written_before_metrics_jsonl_was_appended_still_resumes(tmp_path):
    """Old manifests carried the whole history; a resume takes it from there (and newer ones from metrics.jsonl)."""
    import torch

    from raympi.driver.fit import _resumed

    store = CheckpointStore(str(tmp_path))
    old = [{"step": s, "loss": 1.0 / s} for s in range(1, 13)]
    store.save({"params": {"w": torch.ones(2)}}, {"step": 10, "history": old, "metrics": old[9]})
    run = _resumed(store, {"batch_size": 8})
    assert run.step == run.start_step == 10 and [r["step"] for r in run.history] == list(range(1, 11))
    new = tmp_path / "new"
    store = CheckpointStore(str(new))
    MetricsLog(store.file("metrics.jsonl"), store.fs).append(History.of(old))
    store.save({"params": {"w": torch.ones(2)}}, {"step": 10, "metrics": old[9]})
    run = _resumed(store, {"batch_size": 8})
    assert run.step == 10 and [r["step"] for r in run.history] == list(range(1, 11))


def test_a_warm_restart_keeps_the_steps_the_survivors_finished_marked_as_reconstructed(tmp_path):
    """Rank 1 dies after step 14 with steps 15-18 in flight: ranks 0 and 2 finish them, and the run goes
    on from 18 with those records marked, nothing lost."""
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    survivor = ChunkResult([{"loss": 0.5, "samples": 8} for _ in range(4)], 18)
    chunk = Chunk(14, 18, refs=[survivor, LOST, survivor])  # the fake group's refs are the results
    failure = Failure(FailureKind.WORKER_LOST, "rank 1 died", ranks=(1,), chunks=(chunk,))
    pipeline = ScriptedPipeline(plan, chunk=4, failures={14: failure})  # chunks end at 4, 8, 10, 14
    capacity = iter([2] * 1000)  # rank 1's node is gone with it: no room to grow back
    controller, store = _controller(tmp_path, pipeline, capacity=lambda bundle: next(capacity))
    made = len(FakeGroup.made)
    run = controller.fit()
    store.close()
    assert len(FakeGroup.made) == made + 1  # one group all along
    group = FakeGroup.made[-1]
    assert group.aborted == [0, 2] and group.replaced == [1] and group.reformed == ([0, 2], 0)
    assert pipeline.starts == [0, 18]
    (record,) = run.restarts
    assert (record.path, record.restored_step, record.steps_lost, record.world_after) == ("warm", 18, 0, 2)
    steps = list(run.history)
    assert [r["step"] for r in steps] == list(range(1, 31))
    assert [r["step"] for r in steps if r.get("reconstructed")] == [15, 16, 17, 18]
    assert all(r["loss"] == 0.5 and r["world_size"] == 3 for r in steps[14:18])
    assert run.pace.left == run.pace.watch - 4  # the pace is watched after a warm restart: 4 chunks so far


def test_a_ready_replacement_is_taken_in_by_a_grow(tmp_path):
    """A replacement ready after a chunk: the pipeline stops, the policy says Grow, the group takes it
    in warm (no step lost); its record's recovery time runs to the first step after it."""

    class Growing(FakeGroup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.world, self.ready = 2, True  # started one short; the third is on its way

        def replacement_ready(self):
            return self.ready

        def reform(self, keep, root, deadline):
            self.ready, self.world, self.fresh = False, len(keep) + 1, False
            self.reformed_by = "connected"  # a replacement outside the standby communicator connects

    plan = ChunkPlan(total=20, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=4)
    controller, store = _controller(tmp_path, pipeline, new_group=Growing)
    run = controller.fit()
    store.close()
    (record,) = run.restarts
    assert (record.kind, record.path, record.world_before, record.world_after) == ("replacement_ready", "warm", 2, 3)
    assert record.steps_lost == 0 and record.restored_step == 4 and pipeline.starts == [0, 4]
    assert record.recovery_s is not None and record.recovery_s >= record.reform_s
    assert run.failures == 0 and [r["world_size"] for r in run.history][3:5] == [2, 3]


def test_no_spare_starts_outside_the_group_while_ray_places_a_lost_bundle_again(monkeypatch):
    """A bundle lost with its node puts the placement group in RESCHEDULING, and Ray's GCS then retries it
    with no pause, busy on a core until it fits: a spare outside the group must not take that room.  Stand-ins
    for Ray's placement-group table and free resources; the rest is the group's own code."""
    import raympi.driver.group as group_module
    from raympi.driver.group import WorkerGroup

    state = {"value": "RESCHEDULING"}
    monkeypatch.setattr(group_module, "placement_group_table", lambda pg: {"state": state["value"]})
    monkeypatch.setattr(group_module.ray, "available_resources", lambda: {"CPU": 4.0})
    group = WorkerGroup.__new__(WorkerGroup)
    group.pg, group.bundle, group.spares, spawned = object(), {"CPU": 1.0}, Spares(), []

    class Actor:
        class __ray_ready__:  # noqa: N801  (Ray's name)
            @staticmethod
            def remote():
                return "ready"

    monkeypatch.setattr(group, "_spawn", lambda bundle, rank: spawned.append(bundle) or Actor())
    group._start_spare(None)
    assert spawned == []  # room for it, but the lost bundle waits for that room
    group._start_spare(2)
    assert spawned == [2]  # a freed bundle of the group is the group's own: it may start there
    state["value"] = "CREATED"
    group._start_spare(None)
    assert spawned == [2, None] and len(group.spares.outside) == 2


def test_a_spare_kept_from_the_last_fit_is_used_first_even_with_no_room_left(monkeypatch):
    """A parked spare (keep_workers) holds its resources already: no free room is needed to take it, and it
    is taken before any new spare starts."""
    import raympi.driver.group as group_module
    from raympi.driver.group import WorkerGroup

    monkeypatch.setattr(group_module, "placement_group_table", lambda pg: {"state": "CREATED"})
    monkeypatch.setattr(group_module.ray, "available_resources", lambda: {"CPU": 0.0})
    group = WorkerGroup.__new__(WorkerGroup)
    group.pg, group.bundle, group.spares, spawned = object(), {"CPU": 1.0}, Spares(), []
    group._spec_ref = "spec"

    class Kept:
        class reuse:  # noqa: N801  (the actor method's name)
            @staticmethod
            def remote(spec, rank):
                return ("reused", spec, rank)

    kept = Kept()
    group.spares.parked = [kept]
    monkeypatch.setattr(group, "_spawn", lambda bundle, rank: spawned.append(bundle))
    group._start_spare(None)
    assert group.spares.outside == [Starting(kept, None, ("reused", "spec", -1))] and group.spares.parked == []
    assert spawned == []
    group._start_spare(None)
    assert spawned == []  # no room for a new one


@pytest.mark.parametrize(
    "kind, announced",
    [(FailureKind.EARLY_STOP, False), (FailureKind.COLLECTIVE, True)],
    ids=["a-callback-stops-the-run", "a-collective-failed"],
)
def test_only_a_failure_is_announced_as_a_recovery(tmp_path, kind, announced):
    """A stop asked for (a callback, Ctrl-C or SIGTERM to the driver) printed "recovering at step N"."""
    plan = ChunkPlan(total=30, steps_per_epoch=10, checkpoint_every=10)
    pipeline = ScriptedPipeline(plan, chunk=5, failures={15: Failure(kind, "stop here")})
    controller, store = _controller(tmp_path, pipeline)
    lines: list[str] = []
    controller.announce = lines.append
    controller.fit()
    store.close()
    assert any(line.startswith("recovering at step") for line in lines) is announced, lines


def test_no_straggler_streak_outlives_its_group_nor_counts_a_chunk_run_while_draining(tmp_path):
    """A straggler's streak is counted in the group it was seen in: the chunk that completes while the run drains for
    a planned stop is not counted, and once the group is re-formed (ranks numbered anew, a replacement in the slow
    rank's place) every streak starts again, so the replacement is never blamed for the evicted rank's chunks."""
    from raympi.driver.policy import Warm
    from raympi.driver.report import Progress
    from raympi.driver.run_state import Phase
    from raympi.worker.results import StepTimes

    plan = ChunkPlan(total=100, steps_per_epoch=100)
    controller, store = _controller(tmp_path, ScriptedPipeline(plan), straggler_factor=2.0, straggler_chunks=2)
    controller.progress = Progress(plan.total, False)
    group = FakeGroup(controller.cfg, 2, None, None)
    group.nodes, group.spare_off = ["node-a", "node-b"], lambda nodes: True
    controller.group = group
    slow = [StepTimes(compute_s=0.1), StepTimes(compute_s=0.5)]  # rank 1: 5x its peer, 40 ms a step longer
    step = 0

    def chunk_done() -> Failure | None:
        nonlocal step
        step += 10
        records = [{"step": s, "epoch": 0, "samples_per_s": 100.0} for s in range(step - 9, step + 1)]
        return controller.completed(Chunk(step - 10, step, [], times=slow), records)

    controller._enter(Phase.RUNNING)
    assert chunk_done() is None  # slow once
    controller._enter(Phase.DRAINING)  # a planned stop asked for: this chunk ran on the group about to change
    assert chunk_done() is None
    controller._enter(Phase.RUNNING)
    failure = chunk_done()  # slow twice in a row, counted while running
    assert failure is not None and failure.kind is FailureKind.STRAGGLER and failure.ranks == (1,)
    controller._enter(Phase.RUNNING)
    assert chunk_done() is None  # slow once more: a streak of 1 (the decision reset it)
    controller._carry_out(Warm(survivors=(0,), failed=(1,)), failure)  # re-formed: rank 1 is the spare now
    assert controller.stragglers is not None and controller.stragglers.streak == {}
    assert chunk_done() is None  # the spare's first chunk, slow as it warms up: one chunk, no straggler
    store.close()
