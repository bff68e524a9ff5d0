"""A raympi driver for the multi-host tests: run inside a namespace host, results to a file.

    python tests/multihost_driver.py SPEC.json OUT.pt

SPEC: {"address": "10.213.0.10:6379", "runs": [{"name": ..., "options": {fit options}}, ...]}.
OUT (torch.save): {name: {"params", "restarts", "metrics", "hosts", "seconds"}}.  The model
is defined here, in ``__main__``, so Ray pickles it by value: the workers cannot import tests/.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import ray
import torch
from torch import nn

import raympi
from raympi.driver.capacity import spans_hosts

N = 2048


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 20, generator=g)
    return x, (x[:, 0] + x[:, 1] > 0).long()


class Slow(nn.Sequential):
    """A small MLP that takes at least 20 ms a step, so failures land mid-run."""

    def forward(self, x):
        time.sleep(0.02)
        return super().forward(x)


def net() -> nn.Module:
    torch.manual_seed(0)
    return Slow(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    ray.init(address=spec["address"], logging_level="ERROR", log_to_driver=False)
    out = {
        "driver_host": socket.gethostname(),
        "nodes": [n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]],
        "spans_hosts": spans_hosts({"CPU": 1.0}, []),
    }
    for run in spec["runs"]:
        options = dict(run["options"])
        options["optimizer"] = raympi.optim.sgd(0.05, momentum=0.9)
        if "mpi" in options:
            options["mpi"] = raympi.MPIConfig(**options["mpi"])
        t0 = time.monotonic()
        result = raympi.fit(net(), data(), progress=False, **options)
        out[run["name"]] = {
            "params": {k: v.detach().clone() for k, v in result.state.params.items()},
            "restarts": result.restarts,
            "metrics": result.metrics,
            "seconds": time.monotonic() - t0,
        }
        torch.save(out, out_path)  # after every run: a later failure keeps the earlier results
    ray.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
