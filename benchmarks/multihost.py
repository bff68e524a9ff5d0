"""MPI across hosts vs within one host: communicator formation time and allreduce bandwidth.

Across hosts: three network-namespace hosts joined by veths on a bridge (tests/netns.py, needs
root), one Ray node each (one CPU, token auth), one rank per host (STRICT_SPREAD), MPICH's
OFI/tcp (raympi's choice across hosts).  Within one host: a local Ray instance, ranks on one
node, UCX (raympi's choice there) and OFI/tcp for comparison.

    python benchmarks/multihost.py            # 2 and 3 ranks; 1 and 16 MB
    python benchmarks/multihost.py --quick    # 2 ranks; 1 MB
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from _common import ROOT, pickle_by_value, slowest_median, start_local_ray, time_reps


def measure(
    address: str, ranks: list[int], sizes_mb: list[float], reps: int, netmods: list[str], spread: bool
) -> list[dict]:
    """Form communicators and time allreduce on the Ray cluster at ``address`` (run where a driver may run)."""
    import ray
    import torch
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from raympi import MPIConfig, comm

    class Bench(comm.Member):
        def time_allreduce(self, nbytes: int, reps: int) -> list[float]:
            x = torch.ones(nbytes // 4, dtype=torch.float32)
            return time_reps(self.comm.barrier, lambda: self.comm.allreduce_([x]), reps)  # the first is a warm-up

    if address == "local":
        start_local_ray(max(ranks))
    else:
        pickle_by_value()
        ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    rows = []
    for netmod in netmods:
        env = {**MPIConfig(netmod=netmod).environment(multi_host=spread), "OMP_NUM_THREADS": "1"}
        for n in ranks:
            pg = placement_group([{"CPU": 1}] * n, strategy="STRICT_SPREAD" if spread else "PACK")
            ray.get(pg.ready(), timeout=60)
            actors = [
                ray.remote(Bench)
                .options(
                    num_cpus=1,
                    runtime_env={"env_vars": env},
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                )
                .remote()
                for i in range(n)
            ]
            ray.get([a.__ray_ready__.remote() for a in actors], timeout=60)
            start = time.perf_counter()
            comm.form(actors, timeout_s=60)
            formed = time.perf_counter() - start
            for mb in sizes_mb:
                nbytes = int(mb * 2**20)
                per_rank = ray.get([a.time_allreduce.remote(nbytes, reps) for a in actors], timeout=300)
                t = slowest_median(per_rank)
                rows.append(
                    {
                        "where": "3 hosts (veth)" if spread else "1 host",
                        "netmod": netmod,
                        "ranks": n,
                        "form_s": formed,
                        "MB": mb,
                        "allreduce_ms": 1e3 * t,
                        "bus_MBps": 2 * (n - 1) / n * mb / t,
                    }
                )  # ring all-reduce bus bandwidth
            for a in actors:
                ray.kill(a)
            remove_placement_group(pg)
    ray.shutdown()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--driver", help=argparse.SUPPRESS)  # internal: JSON args, run inside host 0
    args = parser.parse_args()
    if args.driver:
        spec = json.loads(args.driver)
        print("ROWS " + json.dumps(measure(**spec)))
        return
    ranks, sizes = ([2], [1.0]) if args.quick else ([2, 3], [1.0, 16.0])
    reps = 3 if args.quick else args.reps

    sys.path.insert(0, str(ROOT / "tests"))
    import netns

    why = netns.unavailable()
    rows = []
    if why:
        print(f"across hosts: skipped ({why})")
    else:
        cluster = netns.NetnsCluster(3, tag=f"b{__import__('os').getpid() % 1000}", subnet="10.213.2")
        try:
            cluster.create().start_ray()
            spec = dict(address=cluster.address, ranks=ranks, sizes_mb=sizes, reps=reps, netmods=["ofi"], spread=True)
            out = cluster.python(str(pathlib.Path(__file__).resolve()), "--driver", json.dumps(spec), timeout=600)
            rows += json.loads([line for line in out.stdout.splitlines() if line.startswith("ROWS ")][-1][5:])
        finally:
            cluster.teardown()
    rows += measure("local", ranks, sizes, reps, ["ucx", "ofi"], spread=False)

    print(f"{'where':<16}{'netmod':<8}{'ranks':>6}{'form s':>9}{'MB':>6}{'allreduce ms':>14}{'bus MB/s':>10}")
    for r in rows:
        print(
            f"{r['where']:<16}{r['netmod']:<8}{r['ranks']:>6}{r['form_s']:>9.3f}{r['MB']:>6g}"
            f"{r['allreduce_ms']:>14.2f}{r['bus_MBps']:>10.0f}"
        )


if __name__ == "__main__":
    main()
