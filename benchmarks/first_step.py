"""Where the time to the first step goes: ``fit()`` on a small GPT-2 (transformers, built from a config),
from the call to the end of the first step, with the imports of the user's libraries measured apart.

    python benchmarks/first_step.py --runs 3

Each run is a fresh Python (a child process) that imports torch and transformers (timed), builds the
model, then calls ``raympi.fit(..., workers=2)`` on a local Ray instance it starts; the phases are
read from fit's own startup lines (``raympi: [  t s] ...``) and the first step from a callback.
Beside it, fresh Pythons time the imports a worker process pays (``import ray, torch,
raympi.worker`` and ``+ transformers``, as unpickling the model does), and one more takes Ray's start
apart: ``ray.init`` under cProfile (its wait for Ray's dashboard process, for the raylet to register,
the driver's connect), then ``import torch, transformers`` inside one Ray actor once Ray has settled.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys

from _common import run_child, save_results

CHILD = r"""
import json, sys, time
t0 = time.monotonic()
import torch, transformers
imports = time.monotonic() - t0
import raympi
torch.manual_seed(0)
config = transformers.GPT2Config(vocab_size=1000, n_positions=64, n_embd=64, n_layer=8, n_head=4)
model = transformers.GPT2LMHeadModel(config)
ids = torch.randint(0, 1000, (1024, 64))

class First:
    at = None
    def on_step(self, record):
        First.at = First.at or time.monotonic()

start = time.monotonic()
result = raympi.fit(model, {"input_ids": ids, "labels": ids}, workers=2, batch_size=16, max_steps=4,
                    callbacks=[First()], checkpoint_dir=sys.argv[1], address="local")
print("RESULT " + json.dumps({"imports_s": imports, "first_step_s": First.at - start,
                              "params": sum(p.numel() for p in model.parameters())}))
"""

RAY_START = r"""
import cProfile, json, pstats, time
import ray
profile = cProfile.Profile()
t0 = time.monotonic()
profile.enable()
ray.init(address="local", include_dashboard=False, logging_level="ERROR")
profile.disable()
init_s = time.monotonic() - t0
stats = pstats.Stats(profile).stats  # (file, line, function) -> (calls, calls, own s, cumulative s, callers)

def cumulative(file_end, function):
    return sum(v[3] for (f, _, n), v in stats.items() if f.endswith(file_end) and n == function)

@ray.remote(num_cpus=1)
class Imports:
    def time(self):
        t = time.monotonic()
        import torch, transformers
        transformers.GPT2LMHeadModel
        return time.monotonic() - t

time.sleep(3)  # Ray's own processes done starting: the actor's imports alone on the machine
actor_s = ray.get(Imports.remote().time.remote())
print("RESULT " + json.dumps({
    "ray.init (alone)": init_s,
    "  of which waiting for Ray's dashboard process": cumulative("_private/services.py", "start_api_server"),
    "  of which waiting for the raylet to register": cumulative("_private/state.py", "get_node"),
    "  of which the driver's connect": cumulative("_private/worker.py", "connect"),
    "import torch, transformers in one Ray actor": actor_s,
}))
"""

# fit's startup lines, in order: the phase each one opens
PHASES = [
    ("starting Ray", "Ray start"),
    ("connecting to Ray", "Ray start"),
    ("shipping the data", "data to the object store"),
    ("placing", "placement group"),
    ("starting", "worker processes (Python, torch, the model unpickled)"),
    ("joining MPI", "MPI communicator"),
    ("training from step", "first step (setup, autograd and MPI warm-up)"),
]


def phases(output: str, first_step_s: float) -> dict[str, float]:
    """Seconds per phase, from the ``raympi: [  t s] text`` lines (t since fit's start) and the first step."""
    marks = [(float(t), text) for t, text in re.findall(r"raympi: \[\s*([0-9.]+) s\] (.*)", output)]
    out: dict[str, float] = {}
    for i, (t, text) in enumerate(marks):
        name = next((label for key, label in PHASES if text.startswith(key) and label not in out), None)
        if name is None:
            continue
        end = marks[i + 1][0] if i + 1 < len(marks) else first_step_s
        out[name] = end - t
    out["before Ray (validation, a dry-run step on the driver)"] = marks[0][0] if marks else 0.0
    return out


def import_s(code: str) -> float:
    """A fresh Python's time for ``code`` (an import), measured inside it."""
    status, output = run_child(
        [sys.executable, "-c", f"import time; t = time.monotonic(); {code}; print('S', time.monotonic() - t)"], 300
    )
    if status != 0:
        raise RuntimeError(output[-1000:])
    return float(output.split("S ")[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    import tempfile

    runs: list[dict[str, float]] = []
    for run in range(args.runs):
        imports = {
            "import torch, transformers (user)": import_s("import torch, transformers; transformers.GPT2LMHeadModel"),
            "import ray, torch, raympi.worker (a worker)": import_s("import ray, torch, raympi.worker"),
            "import transformers after that (a worker)": import_s(
                "import ray, torch, raympi.worker; t = time.monotonic(); import transformers; "
                "transformers.GPT2LMHeadModel; print('S', time.monotonic() - t); raise SystemExit"
            ),
        }
        status, output = run_child([sys.executable, "-c", RAY_START], 300)
        if status != 0 or "RESULT " not in output:
            raise RuntimeError(output[-2000:])
        ray_start = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
        with tempfile.TemporaryDirectory() as folder:
            status, output = run_child([sys.executable, "-c", CHILD, folder], 600)
        if status != 0 or "RESULT " not in output:
            raise RuntimeError(output[-2000:])
        result = json.loads(output.split("RESULT ", 1)[1].splitlines()[0])
        row = {**imports, **ray_start, **phases(output, result["first_step_s"])}
        row["fit() to first step"] = result["first_step_s"]
        row["params"] = result["params"]
        runs.append(row)
        print(f"run {run + 1}: fit() to the first step {result['first_step_s']:.2f} s", flush=True)
    names = [k for k in runs[0] if k != "params"]
    lines = [
        f"fit() on GPT-2 ({runs[0]['params'] / 1e6:.2f}M parameters), 2 workers, local Ray; "
        f"median of {len(runs)} fresh runs",
        "",
        f"{'phase':<58} {'seconds':>8}",
    ]
    for name in names:
        lines.append(f"{name:<58} {statistics.median(r.get(name, 0.0) for r in runs):8.2f}")
    rows = [{"run": i, **r} for i, r in enumerate(runs)]
    save_results("first_step", rows, "\n".join(lines))


if __name__ == "__main__":
    main()
