"""shard_optimizer: per rank optimizer-state bytes, peak RSS and step time; unsharded, sharded, with buddy copies.

An MLP whose AdamW state dominates (default 52M parameters: 4 Linear layers of 3600 x 3600), trained on
synthetic data by N ranks (Ray actors joined by raympi's MPI communicator, the gradients summed over
MPI: ``make_train_step(grad_sync=comm)`` unsharded, ``shard_optimizer=True`` sharded, and sharded with a
buddy copy of the next rank's slice, as ``fit`` keeps by default), at N = 1, 2 and 4, each configuration
in fresh processes (peak RSS is a process's lifetime maximum).  Per rank:
optimizer-state bytes (the tensors of ``state.opt_state``), peak RSS (``ru_maxrss``) and the median
step time after a warm-up.  Configurations alternate, sharded and unsharded side by side, ``--runs``
times.

    .venv/bin/python benchmarks/shard.py                  # the table in benchmarks/README.md
    .venv/bin/python benchmarks/shard.py --quick          # tiny model, N = 1 and 2: the test suite's smoke run
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import time
from typing import Any

import ray

from _common import OMP1, ROOT, fmt, save_results, start_local_ray

import sys

sys.path.insert(0, str(ROOT))
from raympi import comm  # noqa: E402


@ray.remote(num_cpus=1)
class Rank(comm.Member):
    """One rank: a model, a step over the communicator, and what they cost."""

    def run(self, width: int, layers: int, mode: str, steps: int, batch: int) -> dict[str, Any]:
        import torch
        import torch.nn.functional as F

        from raympi import optim
        from raympi.core import pytree
        from raympi.core.state import TrainState
        from raympi.core.step import make_train_step

        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        comm, shard = self.comm, mode != "unsharded"
        sync = None if comm.size == 1 else comm if shard else comm.allreduce_
        opt = optim.adamw(1e-4)
        step = make_train_step(model, F.mse_loss, opt, grad_sync=sync, shard_optimizer=shard, donate=True)  # as fit
        if shard:
            from raympi.core.shard import shard_state

            buddy = 1 if mode == "buddy" else None
            state = shard_state(TrainState.create(model, optim.set_to_zero()), comm.rank, comm.size, opt, buddy)
        else:
            state = TrainState.create(model, opt)
        del model
        g = torch.Generator().manual_seed(comm.rank)
        x, y = torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)
        times = []
        for i in range(steps):
            comm.barrier()
            t0 = time.perf_counter()
            state, _ = step(state, (x, y), batch * comm.size)
            if i >= 1:
                times.append(time.perf_counter() - t0)
        opt_bytes = sum(t.numel() * t.element_size() for t in pytree.tensor_leaves(state.opt_state))
        params = sum(t.numel() for t in state.params.values())
        return {
            "params": params,
            "opt_state_mb": opt_bytes / 2**20,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "step_s": statistics.median(times),
        }


MODES = ("unsharded", "sharded", "buddy")


def _one(world: int, mode: str, cfg: argparse.Namespace) -> dict[str, Any]:
    ranks = [Rank.options(runtime_env={"env_vars": OMP1}).remote() for _ in range(world)]
    try:
        comm.form(ranks, timeout_s=120)
        out = ray.get([r.run.remote(cfg.width, cfg.layers, mode, cfg.steps, cfg.batch) for r in ranks], timeout=1800)
    finally:
        for r in ranks:
            ray.kill(r)
    return {
        "ranks": world,
        "mode": mode,
        "params_M": out[0]["params"] / 1e6,
        "opt_state_MB_per_rank": max(o["opt_state_mb"] for o in out),
        "peak_rss_MB_per_rank": max(o["peak_rss_mb"] for o in out),
        "step_s": max(o["step_s"] for o in out),  # the slowest rank sets the pace
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a tiny model, 1 and 2 ranks, 1 run")
    ap.add_argument("--width", type=int, default=3600)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--runs", type=int, default=2)
    cfg = ap.parse_args(argv)
    if cfg.quick:
        cfg.width, cfg.layers, cfg.steps, cfg.worlds, cfg.runs = 256, 2, 3, "1,2", 1
    worlds = [int(w) for w in cfg.worlds.split(",")]
    start_local_ray(max(worlds), env=OMP1)
    rows: list[dict[str, Any]] = []
    try:
        for run in range(cfg.runs):
            for world in worlds:
                for mode in MODES if run % 2 == 0 else MODES[::-1]:  # side by side, order alternating
                    if world == 1 and mode == "buddy":
                        continue  # a world of one keeps no copy
                    row = {"run": run, **_one(world, mode, cfg)}
                    rows.append(row)
                    print(row, flush=True)
    finally:
        ray.shutdown()
    table = _table(rows, worlds)
    save_results("shard_quick" if cfg.quick else "shard", rows, table)
    return rows


def _table(rows: list[dict[str, Any]], worlds: list[int]) -> str:
    lines = [
        "| ranks | params | optimizer state per rank (MB): unsharded / sharded / with buddy | ratios | peak RSS "
        "per rank (MB) | step (s) | step ratios |",
        "|---:|---:|---|---|---|---|---|",
    ]
    for world in worlds:
        med = {}
        for mode in MODES:
            mine = [r for r in rows if r["ranks"] == world and r["mode"] == mode]
            if mine:
                med[mode] = {k: statistics.median(r[k] for r in mine) for k in mine[0] if k not in ("mode", "run")}
        u = med["unsharded"]

        def each(key: str, spec: str, ratio: bool = False) -> str:
            if ratio:
                return " / ".join(f"{med[m][key] / u[key]:.2f}" for m in MODES[1:] if m in med)
            return " / ".join(fmt(med[m][key], spec) for m in MODES if m in med)

        lines.append(
            f"| {world} | {u['params_M']:.1f}M | {each('opt_state_MB_per_rank', '.0f')} | "
            f"{each('opt_state_MB_per_rank', '', True)} | {each('peak_rss_MB_per_rank', '.0f')} | "
            f"{each('step_s', '.3f')} | {each('step_s', '', True)} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
