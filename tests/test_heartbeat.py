"""The heartbeat's judgement (raympi.driver.heartbeat.silent_ranks): who is silent, and who is only slow."""

from raympi.driver.heartbeat import SILENT_S, silent_ranks

LATE = SILENT_S + 0.1


def test_a_rank_without_sign_of_life_while_another_answered_a_later_ping_is_silent():
    # rank 1 last answered the ping sent at t=0 and has one in flight since 0.15; rank 0 answered the one of 0.3
    assert silent_ranks({1: 0.15}, {0: 0.3, 1: 0.0}, now=LATE, since=0.0) == [1]


def test_not_silent_before_the_limit():
    assert silent_ranks({1: 0.15}, {0: 0.3, 1: 0.0}, now=SILENT_S - 0.05, since=0.0) == []


def test_a_rank_with_no_ping_in_flight_is_not_judged():
    assert silent_ranks({}, {0: 5.0, 1: 0.0}, now=6.0, since=0.0) == []


def test_nobody_is_blamed_when_every_rank_is_late():
    """The driver itself (or the whole machine) was starved: no rank answered anything recent."""
    assert silent_ranks({0: 0.15, 1: 0.15, 2: 0.15}, {0: 0.0, 1: 0.0, 2: 0.0}, now=5.0, since=0.0) == []


def test_others_must_have_answered_a_ping_sent_after_the_one_in_flight():
    """Rank 0 answered only pings older than rank 1's: no evidence that the driver's pings get through."""
    assert silent_ranks({1: 1.0}, {0: 0.5, 1: 0.0}, now=3.0, since=0.0) == []


def test_several_silent_ranks_are_all_named():
    assert silent_ranks({1: 0.0, 3: 0.1}, {0: 0.5, 2: 0.6}, now=2.0, since=0.0) == [1, 3]


def test_a_rank_that_never_answered_counts_from_when_the_watch_began():
    assert silent_ranks({1: 10.0}, {0: 10.2}, now=10.0 + LATE, since=10.0) == [1]
    assert silent_ranks({1: 10.0}, {0: 10.2}, now=10.5, since=10.0) == []
