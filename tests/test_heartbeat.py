"""The heartbeat (raympi.driver.heartbeat): who is silent, who is only slow, and how the limit follows the machine;
and the stragglers (raympi.driver.stragglers): who is slow in its own work."""

import pytest

from raympi.driver.stragglers import StragglerRule, StragglerWatch, slow_ranks
from raympi.worker.results import StepTimes
from raympi.driver.heartbeat import (
    BEAT_S,
    SILENT_S,
    SLOW_FACTOR,
    START_FACTOR,
    START_FLOOR_SHARE,
    Heartbeat,
    silent_ranks,
    start_hung,
)

LATE = SILENT_S + 0.1


def test_a_rank_whose_ping_is_unanswered_while_another_answered_a_later_one_is_silent():
    # rank 1's ping went out at t=0; rank 0 answered the ping sent at t=0.3
    assert silent_ranks({1: 0.0}, {0: 0.3, 1: -0.15}, now=LATE, silent_s=SILENT_S) == [1]


def test_not_silent_before_the_limit():
    assert silent_ranks({1: 0.0}, {0: 0.3}, now=SILENT_S - 0.05, silent_s=SILENT_S) == []


def test_nobody_is_blamed_when_every_rank_is_late():
    """The driver itself (or the whole machine) was starved: no rank answered anything recent."""
    assert silent_ranks({0: 0.0, 1: 0.0, 2: 0.0}, {0: -0.15, 1: -0.15, 2: -0.15}, now=5.0, silent_s=SILENT_S) == []


def test_others_must_have_answered_a_ping_sent_after_the_late_one():
    """Rank 0 answered only pings older than rank 1's: no evidence that the driver's pings get through."""
    assert silent_ranks({1: 1.0}, {0: 0.5, 1: 0.0}, now=3.0, silent_s=SILENT_S) == []


def test_several_silent_ranks_are_all_named():
    assert silent_ranks({1: 0.0, 3: 0.1}, {0: 0.5, 2: 0.6}, now=2.0, silent_s=SILENT_S) == [1, 3]


STARTUP_S = 120.0
FLOOR_S = START_FLOOR_SHARE * STARTUP_S


def test_a_rank_still_starting_long_after_its_peers_started_is_hung():
    """A starting worker answers no ping: it is judged by how long the others took to start."""
    assert start_hung([2.0, 3.0], waited_s=FLOOR_S + 1, startup_timeout_s=STARTUP_S)
    assert start_hung([10.0], waited_s=START_FACTOR * 10.0 + 1, startup_timeout_s=STARTUP_S)


def test_a_start_is_not_judged_before_the_floor_or_while_no_peer_has_started():
    assert not start_hung([2.0], waited_s=FLOOR_S - 1, startup_timeout_s=STARTUP_S)  # 4x the peers, within the floor
    assert not start_hung([10.0], waited_s=START_FACTOR * 10.0 - 1, startup_timeout_s=STARTUP_S)  # slow peers
    assert not start_hung([], waited_s=10 * FLOOR_S, startup_timeout_s=STARTUP_S)  # all slow: startup_timeout_s decides


def test_a_longer_startup_timeout_gives_a_start_longer():
    """Nodes that start slowly (a runtime_env installed on a new one): raising startup_timeout_s raises the floor."""
    assert start_hung([2.0], waited_s=60.0, startup_timeout_s=120.0)
    assert not start_hung([2.0], waited_s=60.0, startup_timeout_s=600.0)


class _Ping:
    """A fake actor's ping: answered when the test says so."""

    def __init__(self, actor: "_Actor") -> None:
        self.actor = actor

    def remote(self) -> str:
        self.actor.sent += 1
        return f"{self.actor.name}-{self.actor.sent}"


class _Actor:
    def __init__(self, name: str) -> None:
        self.name, self.sent = name, 0
        self.steps = 0  # what its pings report: the count of work done
        self.ping = _Ping(self)


class _Ray:
    """``ray.wait`` over the fake pings: those named in ``answered`` are done; ``ray.get`` of one is the
    count its actor had done when the test answered it."""

    class exceptions:
        RayError = RuntimeError

    def __init__(self) -> None:
        self.answered: dict[str, int] = {}

    def answer(self, refs, actors) -> None:
        by_name = {a.name: a for a in actors}
        for ref in refs:
            self.answered.setdefault(ref, by_name[ref.rsplit("-", 1)[0]].steps)

    def wait(self, refs, num_returns, timeout):
        done = [r for r in refs if r in self.answered]
        return done, [r for r in refs if r not in self.answered]

    def get(self, ref):
        return self.answered[ref]


def _watch(n: int):
    now = [0.0]
    actors = [_Actor(f"r{i}") for i in range(n)]
    watch = Heartbeat(actors, clock=lambda: now[0])
    fake = _Ray()
    watch._ray = fake
    return watch, actors, fake, now


def _beat(watch, fake, now, answering, until: float):
    """Call ``silent`` every BEAT_S until ``until``, the ranks ``answering`` answering every ping at once."""
    found = []
    while now[0] < until:
        fake.answer([watch.unanswered[r][0] for r in answering if r in watch.unanswered], watch.actors)
        now[0] += BEAT_S
        found = watch.silent()
        if found:
            return found, now[0]
    return found, now[0]


def test_a_stopped_rank_is_found_within_a_second_and_the_others_are_not_blamed():
    watch, actors, fake, now = _watch(3)
    found, at = _beat(watch, fake, now, answering=[0, 1, 2], until=2.0)
    assert found == []  # everyone answers: nobody is silent, however long it runs
    stopped_at = now[0]
    found, at = _beat(watch, fake, now, answering=[0, 2], until=stopped_at + 3.0)
    assert found == [1] and at - stopped_at <= SILENT_S + 2 * BEAT_S + 1e-9, (found, at - stopped_at)


def test_the_limit_grows_on_a_machine_that_answers_slowly():
    watch, actors, fake, now = _watch(2)
    assert watch.limit() == SILENT_S
    for _ in range(3):  # every answer comes between the second and the third look (0.15-0.3 s)
        now[0] += BEAT_S
        watch.silent()
        fake.answer([ref for ref, _ in watch.unanswered.values()], actors)
        now[0] += BEAT_S
        watch.silent()
    assert watch.limit() >= SLOW_FACTOR * BEAT_S - 1e-9  # at least the time between two looks, each time


def test_answers_seen_at_the_next_look_do_not_raise_the_limit():
    watch, actors, fake, now = _watch(2)
    for _ in range(5):  # every ping answered before the next look
        fake.answer([ref for ref, _ in watch.unanswered.values()], actors)
        now[0] += BEAT_S
        watch.silent()
    assert watch.limit() == SILENT_S


def test_a_driver_busy_elsewhere_does_not_raise_the_limit():
    watch, actors, fake, now = _watch(2)
    fake.answer([ref for ref, _ in watch.unanswered.values()], actors)
    now[0] += 3.0  # the driver wrote a checkpoint meanwhile: the answers came long ago, unseen
    watch.silent()
    assert watch.limit() == SILENT_S


def test_progress_is_when_every_rank_last_moved_on():
    """Each answer carries the rank's count of steps done: ``last_progress`` is when the slowest of the
    ranks asked about was last seen to move on (what ``step_timeout_s`` counts from)."""
    watch, actors, fake, now = _watch(2)
    _beat(watch, fake, now, answering=[0, 1], until=1.0)
    assert watch.last_progress([0, 1]) == float("-inf")  # nobody has moved on yet: no progress to count from
    actors[0].steps = actors[1].steps = 1
    moved = now[0]
    _beat(watch, fake, now, answering=[0, 1], until=moved + 0.5)
    assert moved <= watch.last_progress([0, 1]) <= moved + BEAT_S + 1e-9
    actors[0].steps = 2  # rank 0 goes on; rank 1 is stuck (alive: it answers, its count stays put)
    later = now[0]
    _beat(watch, fake, now, answering=[0, 1], until=later + 5.0)
    assert watch.last_progress([0]) >= later
    assert watch.last_progress([0, 1]) < later  # the stuck rank holds it back, however long it answers
    assert watch.silent() == []  # it answers: stuck is for step_timeout_s to judge, not the heartbeat


# -- stragglers (raympi.driver.stragglers): a rank slow in its own compute, chunk after chunk ------------------


def _times(compute_ms: list[float], data_ms: list[float] | None = None, steps: int = 10) -> list[StepTimes]:
    data_ms = data_ms or [1.0] * len(compute_ms)
    return [StepTimes(d * steps / 1e3, c * steps / 1e3, 5e-3 * steps) for c, d in zip(compute_ms, data_ms)]


RULE = StragglerRule(factor=3.0, chunks=3, min_step_s=0.01)


@pytest.mark.parametrize(
    "compute_ms, data_ms, slow, data_slow",
    [
        ([20, 21, 19, 70], None, [3], []),  # one rank 3.5x its peers' median: slow
        ([20, 60], None, [1], []),  # two ranks: each is judged against the other, not against a median with itself
        ([60, 63, 58, 61], None, [], []),  # the whole machine slow: every rank alike, none singled out
        ([20, 20, 65, 70], None, [2, 3], []),  # a slow node with half the ranks: each against its peers' median
        ([20, 20, 65, 70, 66, 68], None, [], []),  # ... with more than half: that median is theirs, none is
        ([2, 2, 2, 7], None, [], []),  # 3.5x, but 5 ms a step: noise on tiny steps, not a straggler
        ([20, 21, 19, 20], [1, 1, 1, 40], [], [3]),  # slow in its data, not its compute: reported, not evicted
    ],
    ids=["one-slow", "two-ranks", "machine-slow", "slow-node", "slow-majority", "tiny-steps", "slow-data"],
)
def test_a_slow_rank_is_judged_against_its_peers_compute(compute_ms, data_ms, slow, data_slow):
    assert slow_ranks(_times(compute_ms, data_ms), 10, RULE) == (slow, data_slow)


def test_a_straggler_is_slow_for_chunks_in_a_row_and_a_new_group_starts_afresh():
    watch = StragglerWatch(RULE)
    slow, steady = _times([20, 20, 70]), _times([20, 20, 21])
    assert [watch.observe(t, 10)[0] for t in (slow, slow, steady, slow, slow)] == [[], [], [], [], []]
    assert watch.observe(slow, 10)[0] == [2]  # the third slow chunk in a row
    assert watch.observe(_times([20, 70]), 10)[0] == []  # a group of another size: ranks numbered anew
