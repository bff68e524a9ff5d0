"""The driver's failure policy and chunk plan: pure functions, tested as tables without Ray."""

from __future__ import annotations

import pytest

from raympi.driver.config import parse_config
from raympi.driver.pipeline import ChunkPlan
from raympi.driver.policy import Capacity, Cold, Failure, FailureKind, Grow, Raise, Warm, decide
from raympi.driver.run_state import Checkpoint, Pace, RunState
from raympi.exceptions import PreemptedError, RestartsExhaustedError, TrainingError

K = FailureKind
RUN = RunState(newest=Checkpoint(40, "/ckpt/step-00000040", None))


def _cfg(**kw):
    return parse_config(**{"workers": 3, "batch_size": 64, **kw})


# (name, failure, run, config, capacity, expected decision)
TABLE = [
    (
        "worker lost, survivors",
        Failure(K.WORKER_LOST, "rank 1 died", ranks=(1,)),
        RUN,
        _cfg(),
        Capacity(3, 3),
        Warm(survivors=(0, 2), failed=(1,)),
    ),
    (
        "node lost, no room: survivors go on above min_workers",
        Failure(K.WORKER_LOST, "node", ranks=(2,)),
        RUN,
        _cfg(min_workers=2),
        Capacity(3, 2),
        Warm(survivors=(0, 1), failed=(2,)),
    ),
    ("all ranks lost", Failure(K.WORKER_LOST, "all", ranks=(0, 1, 2)), RUN, _cfg(), Capacity(3, 3), Cold()),
    ("hung rank", Failure(K.HUNG, "rank 2 silent", ranks=(2,)), RUN, _cfg(), Capacity(3, 3), Warm((0, 1), (2,))),
    ("collective failed, peer unknown", Failure(K.COLLECTIVE, "aborted"), RUN, _cfg(), Capacity(3, 3), Cold()),
    ("formation failed", Failure(K.FORMATION, "join", ranks=(1,)), RUN, _cfg(), Capacity(3, 3), Cold()),
    (
        "below min_workers: no room for a replacement",
        Failure(K.WORKER_LOST, "node", ranks=(2,)),
        RUN,
        _cfg(),
        Capacity(3, 2),
        Cold(),
    ),
    (
        "Ray Data: survivors cannot keep their shard",
        Failure(K.WORKER_LOST, "x", ranks=(1,)),
        RunState(warm_possible=False),
        _cfg(),
        Capacity(3, 3),
        Cold(),
    ),
    (
        "worker preempted (SIGTERM): replaced warm",
        Failure(K.PREEMPTED, "sigterm", ranks=(1,)),
        RUN,
        _cfg(),
        Capacity(3, 3),
        Warm((0, 2), (1,)),
    ),
    (
        "worker preempted, no room for a replacement",
        Failure(K.PREEMPTED, "sigterm", ranks=(1,)),
        RUN,
        _cfg(),
        Capacity(3, 2),
        Cold(planned=True),
    ),
    (
        "preemptions do not spend the budget",
        Failure(K.PREEMPTED, "sigterm", ranks=(1,)),
        RunState(failures=3),
        _cfg(max_restarts=3),
        Capacity(3, 3),
        Warm((0, 2), (1,)),
    ),
    ("capacity back", Failure(K.CAPACITY_BACK, "room"), RUN, _cfg(), Capacity(2, 3), Cold(planned=True)),
    (
        "degraded after a warm restart",
        Failure(K.DEGRADED, "15x slower"),
        RunState(failures=3),
        _cfg(max_restarts=3),
        Capacity(2, 2),
        Cold(planned=True),
    ),
    (
        "straggler, a spare elsewhere: evicted warm, even with the budget spent",
        Failure(K.STRAGGLER, "3x slower", ranks=(1,)),
        RunState(failures=3, newest=RUN.newest),
        _cfg(max_restarts=3),
        Capacity(3, 4),
        Warm((0, 2), (1,)),
    ),
    (
        "node draining, a spare elsewhere: its rank moved warm",
        Failure(K.NODE_DRAIN, "drain", ranks=(2,)),
        RUN,
        _cfg(),
        Capacity(3, 3),
        Warm((0, 1), (2,)),
    ),
    (
        "node draining, no room elsewhere, min_workers allows: the others go on without it",
        Failure(K.NODE_DRAIN, "drain", ranks=(2,)),
        RUN,
        _cfg(min_workers=2),
        Capacity(3, 2),
        Warm((0, 1), (2,)),
    ),
    (
        "node draining, no room elsewhere, min_workers does not allow: checkpoint taken, wait for room",
        Failure(K.NODE_DRAIN, "drain", ranks=(2,)),
        RUN,
        _cfg(),
        Capacity(3, 2),
        Cold(planned=True),
    ),
    ("replacement ready", Failure(K.REPLACEMENT_READY, "ready"), RUN, _cfg(), Capacity(2, 3), Grow()),
    (
        "planned stops do not spend the budget",
        Failure(K.CAPACITY_BACK, "room"),
        RunState(failures=3),
        _cfg(max_restarts=3),
        Capacity(2, 3),
        Cold(planned=True),
    ),
    (
        "a warm restart that could not be carried out: cold",
        Failure(K.WORKER_LOST, "rank 1 died", ranks=(1,), warm_skipped="re-forming failed"),
        RUN,
        _cfg(),
        Capacity(3, 3),
        Cold(),
    ),
    (
        "... even with the budget spent by the failure itself",
        Failure(K.HUNG, "rank 2 silent", ranks=(2,), warm_skipped="a survivor did not stop"),
        RunState(failures=3),
        _cfg(max_restarts=3),
        Capacity(3, 3),
        Cold(),
    ),
]


def test_no_capacity_after_a_failure_stops_the_run_with_a_capacity_error():
    from raympi.exceptions import CapacityError

    failure = Failure(K.NO_CAPACITY, "after the failure the cluster can host 1 worker(s)", ranks=(2,))
    decision = decide(failure, RUN, _cfg(), Capacity(0, 1))
    assert isinstance(decision, Raise) and isinstance(decision.error, CapacityError)
    assert "can host 1 worker" in str(decision.error) and failure.followup


@pytest.mark.parametrize("name, failure, run, cfg, capacity, expected", TABLE, ids=[row[0] for row in TABLE])
def test_decide_table(name, failure, run, cfg, capacity, expected):
    assert decide(failure, run, cfg, capacity) == expected


def test_user_error_is_raised_as_it_is():
    error = TrainingError("rank 0 of 2 on h raised ValueError: bad")
    decision = decide(Failure(K.USER_ERROR, "bad", ranks=(0,), error=error), RUN, _cfg(), Capacity(2, 2))
    assert decision == Raise(error)


def test_budget_spent_raises_restarts_exhausted():
    decision = decide(
        Failure(K.WORKER_LOST, "rank 1 died", ranks=(1,)),
        RunState(failures=2, newest=RUN.newest),
        _cfg(max_restarts=2),
        Capacity(3, 3),
    )
    assert isinstance(decision, Raise) and isinstance(decision.error, RestartsExhaustedError)
    text = str(decision.error)
    assert (
        "max_restarts=2" in text and "rank 1 died" in text and "/ckpt/step-00000040" in text and "resume=True" in text
    )


def test_budget_spent_before_any_checkpoint_says_there_is_none():
    decision = decide(
        Failure(K.HUNG, "rank 1 hung", ranks=(1,)), RunState(failures=2), _cfg(max_restarts=2), Capacity(3, 3)
    )
    assert isinstance(decision, Raise) and "No checkpoint was written" in str(decision.error)
    assert "None" not in str(decision.error)


def test_driver_sigterm_raises_preempted_with_the_checkpoint():
    decision = decide(Failure(K.DRIVER_SIGTERM, "stopped by SIGTERM"), RUN, _cfg(), Capacity(3, 3))
    assert isinstance(decision, Raise) and isinstance(decision.error, PreemptedError)
    assert str(decision.error) == (
        "stopped by SIGTERM after step 40; checkpoint written to /ckpt/step-00000040: "
        "fit(..., resume=True) continues from it"
    )


def test_only_infrastructure_failures_count():
    assert {k for k in K if k.counted} == {K.WORKER_LOST, K.HUNG, K.COLLECTIVE, K.FORMATION}


# ---- the chunk plan ---------------------------------------------------------------------------


def test_boundaries_stop_at_epoch_checkpoint_eval_and_end():
    plan = ChunkPlan(total=25, steps_per_epoch=10, checkpoint_every=4, eval_every=6, has_eval=True)
    assert [plan.boundary(s) for s in (0, 4, 6, 8, 10, 20, 24)] == [4, 6, 8, 10, 12, 24, 25]


def test_eval_every_is_ignored_without_an_eval_set():
    plan = ChunkPlan(total=25, steps_per_epoch=10, eval_every=3, has_eval=False)
    assert plan.boundary(0) == 10 and not plan.wants_eval(3) and not plan.wants_eval(10)


def test_eval_at_epoch_ends_and_the_last_step_by_default():
    plan = ChunkPlan(total=25, steps_per_epoch=10, has_eval=True)
    assert [s for s in range(1, 26) if plan.wants_eval(s)] == [10, 20, 25]


def test_checkpoints_every_n_and_at_the_end():
    plan = ChunkPlan(total=25, steps_per_epoch=10, checkpoint_every=8)
    assert [s for s in range(1, 26) if plan.wants_checkpoint(s)] == [8, 16, 24, 25]
    assert [s for s in range(1, 26) if ChunkPlan(total=25, steps_per_epoch=10).wants_checkpoint(s)] == [25]


@pytest.mark.parametrize("count, seconds, expected", [(1, 0.01, 12), (10, 1.0, 5), (100, 0.001, 12), (1, 100.0, 1)])
def test_chunk_size_aims_at_half_a_second_and_never_crosses_a_boundary(count, seconds, expected):
    plan = ChunkPlan(total=1000, steps_per_epoch=20, checkpoint_every=0)
    # at step 8 the next boundary is the epoch end at 20: 12 steps at most
    assert plan.next_size(8, count, seconds) == expected


def test_pace_watch_reports_a_group_left_far_slower_by_a_warm_restart():
    pace, clock = Pace(factor=5.0, chunks=3, min_s=0.0, watch=6), [0.0]

    def feed(rates, every_s=1.0):
        nonlocal pace
        out = []
        for r in rates:
            clock[0] += every_s
            pace, slower = pace.observe(r, clock[0])
            out.append(slower)
        return out

    assert feed((1000.0, 1000.0, 1000.0)) == [None] * 3  # learning the pace
    pace = pace.restarted()
    # one slow chunk (the first after a restart is a single step) is not enough; three in a row are
    assert feed((100.0, 900.0, 100.0, 100.0)) == [None] * 4
    assert feed((50.0,)) == [pytest.approx(1000.0 / 50.0)]
    assert feed((50.0,)) == [None]  # reported once; then it learns the new pace again
    pace = pace.restarted()
    assert feed((900.0, 800.0, 950.0, 900.0, 1000.0, 900.0, 10.0, 10.0, 10.0))[-3:] == [None] * 3  # watch over

    # Over min_s only: a machine busy for a few seconds (9x slower for 4 chunks of 1 s) is not a sick group,
    # and a slow streak is watched to its end, however long the watch.
    pace = Pace(factor=5.0, chunks=3, min_s=10.0, watch=6)
    feed((1000.0,) * 3)
    pace = pace.restarted()
    assert feed((110.0,) * 4 + (1000.0,)) == [None] * 5
    assert feed((100.0,) * 11) == [None] * 10 + [pytest.approx(10.0, rel=0.2)]  # the 11th: 10 s after the first


def test_migrations_are_planned_and_never_counted():
    assert {k for k in K if k.migration} == {K.STRAGGLER, K.NODE_DRAIN}
    assert all(k.planned and not k.counted for k in K if k.migration)


def test_rays_private_drain_calls_are_still_there():
    """raympi.driver.drains reaches into Ray's private API (Ray has no public call for a node's drain): a Ray release
    that moves these breaks preemption notices, and this test says so first.  (test_elastic drains a node for real.)"""
    import ray
    from ray.core.generated import autoscaler_pb2

    assert callable(getattr(ray._private.state.state, "get_draining_nodes", None)), "ray._private.state.state moved"
    assert hasattr(ray._raylet, "GcsClient"), "ray._raylet.GcsClient moved"
    # (GcsClient hands its calls on to this one)
    assert callable(getattr(ray._raylet.InnerGcsClient, "drain_node", None)), "GcsClient's drain_node moved"
    assert autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION") > 0
