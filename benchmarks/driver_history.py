"""The driver's CPU per step as a run grows: flat from 1k to 100k steps?

No Ray and no workers: the real controller, checkpoint store and metrics log, driven by a scripted
pipeline (tests/fakes.py) that completes chunks of ``--chunk`` steps at once and asks for a checkpoint
every ``--every`` steps (a tiny state: what is timed is the driver's bookkeeping, not the write).
Prints the driver's CPU time (process time, every thread) per step in windows of 1,000 steps.

    python benchmarks/driver_history.py                 # 100,000 steps
    python benchmarks/driver_history.py --quick         # 5,000 steps
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fakes import FakeGroup, ScriptedPipeline  # noqa: E402

from raympi.driver.checkpoint import CheckpointStore  # noqa: E402
from raympi.driver.config import parse_config  # noqa: E402
from raympi.driver.controller import Controller  # noqa: E402
from raympi.driver.pipeline import ChunkPlan  # noqa: E402
from raympi.driver.run_state import RunState  # noqa: E402


class Clocked(ScriptedPipeline):
    """Notes the process time at every 1,000th step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.marks: dict[int, float] = {}

    def run(self, group, start, hooks, stop_requested):
        clocked = self

        class Hooks:
            def completed(self, chunk, records):
                out = hooks.completed(chunk, records)
                if chunk.last % 1000 == 0:
                    clocked.marks[chunk.last] = time.process_time()
                return out

            def save(self, state, step):
                return hooks.save(state, step)

        return super().run(group, start, Hooks(), stop_requested)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--chunk", type=int, default=10, help="steps per chunk (fit aims at ~0.5 s of work a chunk)")
    ap.add_argument("--every", type=int, default=1000, help="steps between checkpoints")
    ap.add_argument("--quick", action="store_true", help="5,000 steps")
    args = ap.parse_args(argv)
    steps = 5000 if args.quick else args.steps
    plan = ChunkPlan(total=steps, steps_per_epoch=steps, checkpoint_every=args.every)
    pipeline = Clocked(plan, chunk=args.chunk)
    with tempfile.TemporaryDirectory() as folder:
        cfg = parse_config(workers=2, batch_size=64, progress=False)
        store = CheckpointStore(folder, keep=2)
        controller = Controller(
            cfg,
            spec=type("Spec", (), {"device": "cpu"})(),
            pipeline=pipeline,
            store=store,
            run=RunState(),
            new_group=FakeGroup,
            capacity=lambda bundle: 2,
        )
        began = time.process_time()
        run = controller.fit()
        store.close()
    assert run.step == steps and len(run.history) == steps
    marks = [(0, began)] + sorted(pipeline.marks.items())
    print(f"driver CPU per step, {steps:,} steps in chunks of {args.chunk}, a checkpoint every {args.every:,} steps")
    print(f"{'steps':>16} | {'us/step':>8}")
    print("-" * 28)
    windows = [(a, b, (tb - ta) / (b - a) * 1e6) for (a, ta), (b, tb) in zip(marks, marks[1:])]
    shown = [w for w in windows if w[1] in (1000, 2000, 5000, 10_000, 20_000, 50_000, 100_000) or w[1] == steps]
    for a, b, us in shown:
        print(f"{a + 1:>7,}-{b:>7,} | {us:8.1f}")
    first, last = windows[1][2] if len(windows) > 1 else windows[0][2], windows[-1][2]
    print(f"last window / second window: {last / first:.2f}x (flat: about 1)")


if __name__ == "__main__":
    main()
