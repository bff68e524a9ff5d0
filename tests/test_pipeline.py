"""The chunk pipeline against a fake worker group (no Ray): boundaries, stops, failures mid-chunk."""

from __future__ import annotations

import dataclasses

import pytest

from raympi.driver.config import parse_config
from raympi.driver.data import Sampler
from raympi.driver.pipeline import ChunkPlan, Pipeline
from raympi.driver.policy import Failed, Failure, FailureKind
from raympi.worker.results import ChunkResult, Evaluated

K = FailureKind


@dataclasses.dataclass
class Call:
    method: str
    args: tuple


class FakeActor:
    """Records calls; ``.x.remote(...)`` returns a Call that the fake group 'computes' in gather."""

    def __init__(self, group: "FakeGroup", rank: int) -> None:
        self.group, self.rank = group, rank

    def __getattr__(self, method: str):
        actor = self

        class _Remote:
            def remote(self, *args):
                call = Call(method, args)
                actor.group.calls.append((actor.rank, call))
                return call

        return _Remote()


class FakeGroup:
    def __init__(self, world: int, fail_at: tuple[str, int] | None = None, sigterm_at: int | None = None) -> None:
        self.world, self.calls, self.fail_at, self.sigterm_at = world, [], fail_at, sigterm_at
        self.fresh = True
        self.actors = [FakeActor(self, r) for r in range(world)]
        self.joins = 0

    def join_spares(self):
        self.joins += 1  # asked between chunks: this group has no spares

    def gather(self, refs, deadline, what, heartbeat=False):
        out = []
        for call in refs:
            if call.method == "run":
                steps = call.args[0]
                last = self._step_of(call) + len(steps)
                if self.fail_at == ("run", last):
                    raise Failed(Failure(K.WORKER_LOST, f"rank 1 died in {what}", ranks=(1,)))
                sigterm = self.sigterm_at is not None and last >= self.sigterm_at
                out.append(ChunkResult([{"loss": 1.0} for _ in steps], last, sigterm=sigterm))
            elif call.method == "evaluate":
                if self.fail_at and self.fail_at[0] == "evaluate":
                    raise Failed(Failure(K.WORKER_LOST, "rank 1 died in evaluation", ranks=(1,)))
                aborted = self.fail_at and self.fail_at[0] == "evaluate_aborted" and len(out) == 1
                out.append(Evaluated(aborted=True) if aborted else Evaluated({"eval_loss": 0.5}))
        return out

    def _step_of(self, call: Call) -> int:
        return call.args[2]  # the test pipeline passes the chunk's first step along (see below)


class TestPipeline(Pipeline):
    """Passes the chunk's first step to the fake actors so the fake group knows where it is."""

    __test__ = False

    def submit(self, group, first, count):
        chunk = super().submit(group, first, count)
        for call in chunk.refs:
            call.args = (*call.args, first)
        return chunk


class Hooks:
    def __init__(self, on_step: dict[int, Failure] | None = None) -> None:
        self.steps: list[int] = []
        self.records: list[dict] = []
        self.saved: list[int] = []
        self.drains: list[Failure] = []
        self.on_step = on_step or {}

    def completed(self, chunk, records):
        self.steps += [r["step"] for r in records]
        self.records += records
        return self.on_step.get(chunk.last)

    def save(self, state_ref, step):
        self.saved.append(step)
        return None

    def draining(self, stop):
        self.drains.append(stop)


def _pipeline(total=25, spe=10, checkpoint_every=8, eval_size=0, eval_every=0) -> TestPipeline:
    cfg = parse_config(workers=2, batch_size=4, checkpoint_every=checkpoint_every)
    plan = ChunkPlan(
        total=total,
        steps_per_epoch=spe,
        checkpoint_every=checkpoint_every,
        eval_every=eval_every,
        has_eval=eval_size > 0,
    )
    return TestPipeline(plan, Sampler(0, 4, 40, range(2, 3)), cfg, eval_size)


def test_runs_every_step_once_and_checkpoints_at_the_planned_steps():
    hooks = Hooks()
    assert _pipeline().run(FakeGroup(2), 0, hooks, lambda: None) is None
    assert hooks.steps == list(range(1, 26))
    assert hooks.saved == [8, 16, 24, 25]


def test_each_rank_gets_its_epoch_and_its_slice_of_the_global_batch():
    group = FakeGroup(2)
    _pipeline(total=12).run(group, 0, Hooks(), lambda: None)
    runs = [(rank, call.args[0]) for rank, call in group.calls if call.method == "run"]
    epochs = [e for rank, steps in runs if rank == 0 for e, _ in steps]
    assert epochs == [0] * 10 + [1] * 2
    for rank, steps in runs:
        assert all(len(index) == 2 for _, index in steps)


def test_stop_before_anything_was_sent_checkpoints_and_returns_it():
    hooks = Hooks()
    stop = Failure(K.DRIVER_SIGTERM, "stopped by SIGTERM")
    assert _pipeline().run(FakeGroup(2), 5, hooks, lambda: stop) is stop
    assert hooks.steps == [] and hooks.saved == [5] and hooks.drains == [stop]


def test_a_driver_sigterm_is_not_overtaken_by_a_later_stop():
    sigterm = Failure(K.DRIVER_SIGTERM, "stopped by SIGTERM")
    hooks = Hooks(on_step={1: None, 3: Failure(K.REPLACEMENT_READY, "ready")})
    asked = iter([None, None, sigterm])
    result = _pipeline().run(FakeGroup(2), 0, hooks, lambda: next(asked, sigterm))
    assert result is sigterm
    assert hooks.saved and hooks.saved[-1] == hooks.steps[-1]  # checkpoint of the step reached: nothing lost


def test_worker_preemption_drains_and_checkpoints_the_step_reached():
    hooks = Hooks()
    result = _pipeline(checkpoint_every=0).run(FakeGroup(2, sigterm_at=3), 0, hooks, lambda: None)
    assert result.kind is K.PREEMPTED
    assert hooks.saved == [hooks.steps[-1]] and hooks.steps == list(range(1, hooks.steps[-1] + 1))


def test_a_lost_worker_returns_the_failure_with_the_chunks_in_flight():
    hooks = Hooks()
    result = _pipeline().run(FakeGroup(2, fail_at=("run", 8)), 0, hooks, lambda: None)
    assert result.kind is K.WORKER_LOST and result.ranks == (1,)
    assert result.chunks and result.chunks[0].last == 8
    assert hooks.steps == list(range(1, result.chunks[0].first + 1))


def test_a_worker_lost_in_evaluation_still_records_the_steps_done_and_the_restart_evaluates_first():
    hooks, pipeline = Hooks(), _pipeline(total=12, eval_size=8, checkpoint_every=10)
    result = pipeline.run(FakeGroup(2, fail_at=("evaluate", 0)), 0, hooks, lambda: None)
    assert result.kind is K.WORKER_LOST
    assert hooks.steps == list(range(1, 11))  # the epoch's steps are done; their state is on the survivors
    assert hooks.saved == [] and "eval_loss" not in hooks.records[-1]  # cut short with the evaluation
    after = Hooks()
    assert pipeline.run(FakeGroup(2), 10, after, lambda: None) is None  # the group after a warm restart
    assert after.steps == [10, 11, 12]  # step 10 again, now with its evaluation: nothing lost
    assert after.records[0]["eval_loss"] == 0.5 and after.records[0]["loss"] == 1.0
    assert after.saved == [10, 12]


def test_an_abandoned_collective_in_evaluation_is_an_infrastructure_failure():
    hooks = Hooks()
    result = _pipeline(total=12, eval_size=8).run(FakeGroup(2, fail_at=("evaluate_aborted", 0)), 0, hooks, lambda: None)
    assert result.kind is K.COLLECTIVE and result.kind.counted, result


def test_an_owed_evaluation_is_dropped_when_training_goes_back_further():
    hooks, pipeline = Hooks(), _pipeline(total=12, eval_size=8, checkpoint_every=10)
    pipeline.run(FakeGroup(2, fail_at=("evaluate", 0)), 0, hooks, lambda: None)
    after = Hooks()
    pipeline.run(FakeGroup(2), 8, after, lambda: None)  # a cold restart from the checkpoint of step 8
    assert after.steps == [9, 10, 11, 12] and "eval_loss" in after.records[1]


@pytest.mark.parametrize("start", [0, 7, 24])
def test_resumes_at_any_step(start):
    hooks = Hooks()
    _pipeline().run(FakeGroup(3), start, hooks, lambda: None)
    assert hooks.steps == list(range(start + 1, 26))


def test_a_new_group_starts_with_one_step_and_a_re_formed_one_at_the_last_chunks_pace():
    """A group's first chunk is one step (a new group's warms up autograd and MPI, a re-formed one's says soon that it
    is back); after a warm restart the chunk sent with it is sized by the last chunk's pace, not one step again (each
    chunk costs a round trip)."""
    pipeline = _pipeline(total=40, spe=40, checkpoint_every=0)
    assert pipeline.run(FakeGroup(2), 0, Hooks(), lambda: None) is None
    for fresh, first_two in ((False, [1, 29]), (True, [1, 1])):
        group = FakeGroup(2)
        group.fresh = fresh
        assert pipeline.run(group, 10, Hooks(), lambda: None) is None
        sizes = [len(call.args[0]) for rank, call in group.calls if rank == 0 and call.method == "run"]
        assert sizes[:2] == first_two and sum(sizes) == 30, (fresh, sizes)
