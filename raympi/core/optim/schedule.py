"""Learning-rate schedules: callables ``count -> lr`` for any optimizer's ``lr``.

Step ``k`` (from 0) of an optimizer given a schedule uses ``lr(k)``; the
count is the optimizer state's CPU counter, so evaluating a schedule never
waits on an accelerator.  Modelled on optax's ``_src/schedule.py``.
"""

from __future__ import annotations

import math

from raympi.core.optim.base import ScalarOrSchedule, Schedule

__all__ = ["constant", "cosine_decay", "linear_warmup"]


def constant(value: float) -> Schedule:
    """A schedule that always returns ``value``.

    Example:
        >>> constant(0.1)(1000)
        0.1
    """
    return lambda count: value


def cosine_decay(init_value: float, decay_steps: int, alpha: float = 0.0) -> Schedule:
    """Cosine decay from ``init_value`` to ``alpha * init_value`` over ``decay_steps``.

    Args:
        init_value: the value at step 0.
        decay_steps: steps until the floor is reached; it stays there after.
        alpha: the floor, as a fraction of ``init_value``.

    Returns:
        A schedule ``count -> lr``.

    Example:
        >>> round(cosine_decay(1.0, 100)(50), 6)
        0.5
    """
    if decay_steps <= 0:
        raise ValueError(f"decay_steps must be > 0, got {decay_steps}")

    def schedule(count: int) -> float:
        frac = min(count, decay_steps) / decay_steps
        return init_value * ((1 - alpha) * 0.5 * (1 + math.cos(math.pi * frac)) + alpha)

    return schedule


def linear_warmup(warmup_steps: int, schedule: ScalarOrSchedule, init_value: float = 0.0) -> Schedule:
    """Ramp linearly from ``init_value`` to ``schedule``'s start, then follow it.

    Step ``k < warmup_steps`` gives ``init + (peak - init) * k / warmup_steps``
    with ``peak = schedule(0)``; after that, ``schedule(k - warmup_steps)``.

    Args:
        warmup_steps: length of the ramp.
        schedule: a float or the schedule that follows the ramp.
        init_value: the value at step 0.

    Returns:
        A schedule ``count -> lr``.

    Example:
        >>> lr = linear_warmup(100, cosine_decay(1e-3, 900))
        >>> lr(50), lr(100)
        (0.0005, 0.001)
    """
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    after = schedule if callable(schedule) else constant(float(schedule))

    def warm(count: int) -> float:
        if count < warmup_steps:
            peak = after(0)
            return init_value + (peak - init_value) * count / warmup_steps
        return after(count - warmup_steps)

    return warm
