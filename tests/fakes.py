"""Stand-ins for the Ray side of a run, to drive the controller with no Ray: a worker group that
only counts, and a pipeline that plays a script of completed steps, checkpoints and failures.

Used by tests/test_controller.py.
"""

from __future__ import annotations

import time
from typing import Any

from raympi.driver.pipeline import Chunk, ChunkPlan
from raympi.driver.policy import Failed, Failure
from raympi.driver.spares import Spares


class FakeGroup:
    """A worker group of ``world`` ranks that never runs anything (the pipeline is a fake too)."""

    made: list["FakeGroup"] = []

    def __init__(self, cfg: Any, world: int, spec: Any, state: Any, ray_dataset: Any = None, **options: Any) -> None:
        self.world, self.state, self.options = world, state, options
        self.spares, self.fresh, self.closed = Spares(), True, False
        self.reformed_by = ""
        FakeGroup.made.append(self)

    def start(self) -> "FakeGroup":
        return self

    def label_silent(self, wait: bool = False) -> list[tuple[int, bool]]:
        return []

    def replacement_ready(self) -> bool:
        return False

    def shutdown(self, park: bool = False) -> None:
        self.closed, self.parked = True, park

    # The warm path: a chunk's "refs" here are the results themselves (or LOST), already there.

    def abort(self, ranks: Any) -> None:
        self.aborted = list(ranks)

    def replace(self, failed: list[int], avoid: frozenset[str] = frozenset()) -> None:
        self.replaced = [*getattr(self, "replaced", []), *failed]

    def outcomes(self, calls: dict[int, Any], timeout_s: float) -> dict[int, Any] | None:
        return dict(calls)

    def snapshot(self, rank: int) -> Any:
        return {"from_rank": rank}

    def holds(self, snapshot: Any, timeout_s: float) -> bool:
        return True

    def reform(self, keep: list[int], root: int, deadline: Any) -> None:
        """The kept ranks go on (no replacement is ever ready here): the group shrinks to them."""
        self.reformed, self.reformed_by = (list(keep), root), "derived"
        self.world = len(keep)
        self.fresh = False


def failing_group(failure: Failure):
    """A group factory whose groups fail to start with ``failure`` (as a real one raises ``Failed``)."""

    def make(*args: Any, **kwargs: Any) -> FakeGroup:
        raise Failed(failure)

    return make


class ScriptedPipeline:
    """Plays steps ``start+1 .. plan.total`` in chunks of ``chunk``, rank 0's state saved at every
    checkpoint step of the plan; ``failures`` maps a step to the failure returned once it is done."""

    def __init__(
        self,
        plan: ChunkPlan,
        chunk: int = 4,
        failures: dict[int, Failure] | None = None,
        state: dict[str, Any] | None = None,
    ) -> None:
        self.plan, self.chunk, self.failures = plan, chunk, dict(failures or {})
        self.state = state if state is not None else {"step": 0}
        self.starts: list[int] = []

    def run(self, group: Any, start: int, hooks: Any, stop_requested: Any) -> Failure | None:
        self.starts.append(start)
        step = start
        while step < self.plan.total:
            last = min(self.plan.boundary(step), step + self.chunk)
            records = [
                {
                    "step": s,
                    "epoch": (s - 1) // self.plan.steps_per_epoch,
                    "loss": 1.0 / s,
                    "samples": 8,
                    "samples_per_s": 1000.0,
                    "world_size": group.world,
                    "time": time.time(),
                }
                for s in range(step + 1, last + 1)
            ]
            stop = hooks.completed(Chunk(step, last, []), records)
            if self.plan.wants_checkpoint(last):
                stop = stop or hooks.save({**self.state, "step": last}, last)
            step = last
            for s in [s for s in self.failures if s <= step]:
                return self.failures.pop(s)
            if stop is not None:
                return stop
        return None
