"""Cost model: per-step gradient communication of raympi's transports at 8 GPUs and 128 nodes x 8 GPUs.

Pure arithmetic (no Ray, no GPU, no MPI): ResNet-50 and a 1B-parameter transformer, each at 8 GPUs
on one node and at 1,024 GPUs (128 nodes of 8), through

- ``nccl``: a ProcessGroupNCCL all-reduce of each bucket on a communication stream as soon as
  backward fills it (DDP's scheme), 16-bit gradients summed in 16 bits;
- ``mpi``: each bucket copied device -> pinned host on a side stream, summed by MPI on the CPU by
  one reduction thread (shared memory within a node, TCP between nodes: the PyPI MPICH over
  OFI/tcp), and copied back once backward has ended (``BucketAllreduce.finish``: each bucket as
  soon as its own sum is done, overlapping the later sums); 16-bit gradients are widened to
  float32 for MPI, so its wire bytes are always float32's (the PCIe copies are counted at float32
  too, an upper bound);

plus the driver's CPU per step and a checkpoint's blocked time.  Every figure is a range: the
fast end evaluates the model with each constant's favourable end, the slow end with the other.
Each constant says where it comes from: *measured* on this 2-core machine (benchmarks/README.md and docs/benchmarks.md),
*published* (vendor specs, nccl-tests results), or *assumed*.

    python tools/cost_model.py            # the markdown table (tools/README.md, "Cost model")
    python tools/cost_model.py --json     # rows and constants as JSON
    python tools/cost_model.py --measure  # also time np.add of float32 here (the CPU sum rate)

Time of one bucket of b bytes over N ranks (nccl-tests' definition: busbw = algbw x 2(N-1)/N,
so a measured busbw gives the time directly):

    t(b) = alpha + b x 2(N-1)/N / busbw   (+ for MPI across nodes: (N-1)/N x b / sum_rate)

Overlap: buckets fill at even intervals over backward (time B) and one stream (NCCL) or one
reduction thread (MPI) sums them in order; the exposed time is what ends after backward.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import time
from typing import Any

MiB = 2**20
BUCKET = 16 * MiB  # raympi's bucket_bytes default (the first bucket is at most 1 MiB: ignored here)
CHUNK_S, MAX_CHUNK = 0.5, 512  # raympi.driver.pipeline: a chunk is ~0.5 s of steps, at most 512

# name: (fast end, slow end, source)
CONST: dict[str, tuple[float, float, str]] = {
    "nvlink_busbw": (
        480e9,
        360e9,
        "published: NCCL all_reduce busbw reported by nccl-tests on DGX H100 (NVLink4 / NVSwitch, "
        "900 GB/s bidirectional per GPU in NVIDIA's DGX H100 spec); A100: ~230 GB/s",
    ),
    "ib_busbw": (
        45e9,
        40e9,
        "published/typical: nccl-tests all_reduce busbw across DGX H100 nodes, 8 x ConnectX-7 400 Gb/s NDR per node "
        "(one per GPU, DGX H100 spec), 50 GB/s line rate per GPU",
    ),
    "nccl_alpha_node": (10e-6, 20e-6, "assumed: one NCCL all-reduce's latency on one NVSwitch node"),
    "nccl_alpha_cluster": (
        0.1e-3,
        0.5e-3,
        "assumed: one NCCL all-reduce's latency over 128 nodes "
        "(tree ~ 2 log2(128) hops, ring ~ 2 x 127 hops of a few us)",
    ),
    "pcie": (
        25e9,
        20e9,
        "assumed: device <-> pinned host per GPU while all 8 copy: 4 PCIe Gen5 x16 uplinks (~50 GB/s effective per "
        "direction each), 2 GPUs per uplink",
    ),
    "shm_beta": (
        11.4e9,
        8.2e9,
        "measured here: MPI allreduce busbw between 2 ranks in shared memory, UCX, 1 MB / 16 MB (scale.py; "
        "includes the sum)",
    ),
    "host_dram": (
        500e9,
        400e9,
        "assumed: host memory bandwidth, 2 x Xeon 8480C, 16 channels DDR5-4800 (614 GB/s peak, DGX H100 spec)",
    ),
    "dram_per_bus_byte": (
        4.0,
        5.0,
        "assumed: DRAM bytes moved per bus byte of a shared-memory allreduce (copy in, copy out, read and add)",
    ),
    "mpi_alpha_shm": (6.3e-6, 17e-6, "measured here: 8 B allreduce between 2 ranks, UCX (scale.py)"),
    "mpi_alpha_tcp": (30e-6, 50e-6, "assumed: one TCP message between nodes through OFI/tcp"),
    "tcp_core": (
        3e9,
        0.75e9,
        "slow end measured here (754 MB/s busbw at 16 MB, 2 ranks over veths, OFI/tcp, multihost.py); "
        "fast end assumed: one server core's TCP send + receive",
    ),
    "tcp_efficiency": (0.9, 0.7, "assumed: TCP payload rate / NIC line rate with 8 ranks' connections"),
    "sum_rate": (
        13.5e9,
        8e9,
        "measured here: np.add float32 in place, one core, 7.9-17.7 GB/s over three runs at 16 / 64 MB (--measure); "
        "MPICH's own loop assumed no faster",
    ),
    "driver_rank_step": (
        40e-6,
        65e-6,
        "measured here: 65 us per rank and step with tensor indices (scale.py b); 40 us derived for numpy indices, "
        "which the driver sends now (65 - 34 + 9), not re-measured",
    ),
    "ckpt_d2h": (25e9, 20e9, "assumed: rank 0's device -> host copy"),
    "ckpt_write": (2e9, 1e9, "assumed: NVMe or object store; here ~0.3 GB/s (checkpoint_large.py)"),
}
DRIVER_CHUNK_S, DRIVER_RANK_CHUNK_S = 0.24e-3, 381e-6  # measured here: scale.py part b, least squares


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    params: float
    compute_s: float  # forward + backward + optimizer, one step, no communication
    backward_frac: float
    state_bytes: float  # what a checkpoint holds
    note: str


def _transformer_step(params: float, tokens: int, peak: float, mfu: float) -> float:
    return 6 * params * tokens / (peak * mfu)


WORKLOADS = [
    Workload(
        "ResNet-50",
        25.6e6,
        256 / 3000,
        2 / 3,
        2 * 4 * 25.6e6,
        "assumed: ~3000 img/s per H100 in bf16 (MLPerf-class) at batch 256 per GPU: 85 ms a step, backward 2/3; "
        "SGD + momentum: state 0.2 GB",
    ),
    Workload(
        "1B transformer",
        1e9,
        _transformer_step(1e9, 16384, 989e12, 0.40),
        2 / 3,
        12e9,
        "assumed: 16,384 tokens per GPU per step (8 x 2048), 6 x params FLOPs a token, H100 bf16 dense peak 989 "
        "TFLOP/s (NVIDIA spec) at 40 % MFU: 248 ms a step, backward 2/3; fp32 master weights + Adam: state 12 GB",
    ),
]


def _const(end: int) -> dict[str, float]:
    return {k: v[end] for k, v in CONST.items()}


def _buckets(nbytes: float) -> list[float]:
    full, rest = divmod(nbytes, BUCKET)
    return [float(BUCKET)] * int(full) + ([rest] if rest else [])


def _pipeline(buckets: list[float], backward_s: float, stages: list) -> tuple[float, float, float]:
    """Serial stages per bucket, each stage one engine (a stream, a thread, a DMA direction).

    Buckets are ready at even intervals over backward; a stage given as ``(fn, True)`` starts no
    earlier than backward's end.  Returns (the sum of every stage of every bucket, the time the
    last stage ends after backward ends, that part of it spent waiting on the stages flagged True)."""
    k = len(buckets)
    free = [0.0] * len(stages)
    total = 0.0
    before = 0.0  # when the unflagged stages of the last bucket ended
    for i, b in enumerate(buckets):
        t = backward_s * (i + 1) / k
        for j, stage in enumerate(stages):
            fn, after_backward = stage if isinstance(stage, tuple) else (stage, False)
            d = fn(b)
            total += d
            t = max(t, free[j], backward_s if after_backward else 0.0) + d
            free[j] = t
            if not after_backward:
                before = max(before, t)
    exposed = max(0.0, t - backward_s)
    return total, exposed, exposed - max(0.0, before - backward_s)


def _nccl(c: dict, nbytes: float, ranks: int, backward_s: float) -> dict:
    f = 2 * (ranks - 1) / ranks
    if ranks <= 8:
        alpha, bw, limit = c["nccl_alpha_node"], c["nvlink_busbw"], "NVLink busbw"
    else:
        alpha, bw, limit = c["nccl_alpha_cluster"], c["ib_busbw"], "InfiniBand busbw per GPU (400 Gb/s)"
    total, exposed, _ = _pipeline(_buckets(nbytes), backward_s, [lambda b: alpha + b * f / bw])
    terms = {limit: nbytes * f / bw, "NCCL latency per bucket": alpha * len(_buckets(nbytes))}
    return {
        "total_s": total,
        "exposed_s": exposed,
        "terms": terms,
        "exposed_terms": {max(terms, key=terms.get): exposed},
    }


def _mpi(c: dict, nbytes: float, ranks: int, backward_s: float, nic_gbps: float = 0, nics: int = 1) -> dict:
    f = 2 * (ranks - 1) / ranks
    pcie = c["pcie"]
    if ranks <= 8:
        cap_dram = c["host_dram"] / (ranks * c["dram_per_bus_byte"])
        caps = {"shared-memory copy rate per rank": c["shm_beta"], "host DRAM shared by 8 ranks": cap_dram}
        alpha = 2 * math.ceil(math.log2(ranks)) * c["mpi_alpha_shm"]
        sum_per_byte = 0.0  # inside the measured shm_beta
    else:
        ranks_per_nic = 8 // nics
        caps = {
            f"{nic_gbps:.0f} Gb/s NIC shared by {ranks_per_nic} ranks" if ranks_per_nic > 1 else "NIC per GPU": c[
                "tcp_efficiency"
            ]
            * nic_gbps
            * 1e9
            / 8
            / ranks_per_nic,
            "TCP stack of one core per rank": c["tcp_core"],
        }
        alpha = 2 * math.ceil(math.log2(ranks)) * c["mpi_alpha_tcp"]
        sum_per_byte = (ranks - 1) / ranks / c["sum_rate"]
    cap_name = min(caps, key=caps.get)
    rate = caps[cap_name]
    buckets = _buckets(nbytes)
    stages = [
        lambda b: b / pcie,  # device -> pinned host, side stream
        lambda b: alpha + b * f / rate + b * sum_per_byte,  # MPI, the reduction thread
        (lambda b: b / pcie, True),
    ]  # host -> device in finish(), after backward
    total, exposed, tail = _pipeline(buckets, backward_s, stages)
    terms = {
        cap_name: nbytes * f / rate,
        "PCIe copies (both ways)": 2 * nbytes / pcie,
        "CPU sum": nbytes * sum_per_byte,
        "MPI latency": alpha * len(buckets),
    }
    exposed_terms = {
        max(terms, key=terms.get): exposed - tail,
        "copies back to the GPU, which wait for backward's end": tail,
    }
    return {"total_s": total, "exposed_s": exposed, "terms": terms, "exposed_terms": exposed_terms}


def _driver(c: dict, workers: int, step_s: float) -> dict:
    k = max(1, min(MAX_CHUNK, int(CHUNK_S / step_s)))
    per_chunk = DRIVER_CHUNK_S + DRIVER_RANK_CHUNK_S * workers + c["driver_rank_step"] * workers * k
    per_step = per_chunk / k
    saturates = (k * step_s - DRIVER_CHUNK_S) / (DRIVER_RANK_CHUNK_S + c["driver_rank_step"] * k)
    return {
        "total_s": per_step,
        "exposed_s": max(0.0, per_step - step_s),
        "k": k,
        "cores": per_step / step_s,
        "saturates_at": saturates,
    }


def _fmt_s(lo: float, hi: float) -> str:
    if hi < 1.0:
        a, b, u = lo * 1e3, hi * 1e3, "ms"
    else:
        a, b, u = lo, hi, "s"
    digits = 2 if b < 10 else (1 if b < 100 else 0)
    sa, sb = f"{a:.{digits}f}", f"{b:.{digits}f}"
    return f"{sa} {u}" if sa == sb else f"{sa}-{sb} {u}"


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def _names(fast: dict, slow: dict, key: str) -> str:
    names = []
    for r in (fast, slow):
        name = max(r[key], key=r[key].get)
        if name not in names:
            names.append(name)
    return " / ".join(names)


def _limit(fast: dict, slow: dict, compute_s: float) -> str:
    """The term behind most of the exposed time (fast end / slow end when they differ)."""
    if slow["exposed_s"] < 0.05 * compute_s:
        return f"none: hidden under backward (largest term: {_names(fast, slow, 'terms')})"
    return _names(fast, slow, "exposed_terms")


def _pair(a: float, b: float) -> tuple[float, float]:
    return (min(a, b), max(a, b))


def rows() -> list[dict[str, Any]]:
    fast, slow = _const(0), _const(1)
    out = []
    for w in WORKLOADS:
        bwd = w.compute_s * w.backward_frac
        for gpus in (8, 1024):
            variants = [("nccl", "fp32 grads", 4, {}), ("nccl", "bf16 grads", 2, {})]
            if gpus == 8:
                variants.append(("mpi", "shared memory (fp32 on the wire; bf16 grads widened)", 4, {}))
            else:
                variants += [
                    ("mpi", "TCP, one 100 Gb/s NIC per node (fp32 on the wire)", 4, {"nic_gbps": 100, "nics": 1}),
                    ("mpi", "TCP, one 400 Gb/s NIC per node", 4, {"nic_gbps": 400, "nics": 1}),
                    ("mpi", "TCP over 8 x 400 Gb/s NICs (one per GPU)", 4, {"nic_gbps": 400, "nics": 8}),
                ]
            best_step = None
            for transport, variant, width, kw in variants:
                nbytes = w.params * width
                fn = _nccl if transport == "nccl" else _mpi
                rf, rs = fn(fast, nbytes, gpus, bwd, **kw), fn(slow, nbytes, gpus, bwd, **kw)
                step = (w.compute_s + rf["exposed_s"], w.compute_s + rs["exposed_s"])
                if best_step is None or step[1] < best_step[1]:
                    best_step = step
                out.append(
                    {
                        "workload": w.name,
                        "gpus": gpus,
                        "term": f"gradients, `{transport}`",
                        "variant": variant,
                        "bytes": nbytes,
                        "total_s": (rf["total_s"], rs["total_s"]),
                        "exposed_s": (rf["exposed_s"], rs["exposed_s"]),
                        "step_x": (
                            (w.compute_s + rf["exposed_s"]) / w.compute_s,
                            (w.compute_s + rs["exposed_s"]) / w.compute_s,
                        ),
                        "first_limit": _limit(rf, rs, w.compute_s),
                    }
                )
            df, ds = _driver(fast, gpus, best_step[0]), _driver(slow, gpus, best_step[1])
            cores = _pair(df["cores"], ds["cores"])
            sat = _pair(df["saturates_at"], ds["saturates_at"])
            ks = sorted({df["k"], ds["k"]})
            chunk = f"chunks of {'-'.join(map(str, ks))} step{'s' if ks[-1] > 1 else ''}"
            where = f"one core is full at ~{sat[0]:.0f}-{sat[1]:.0f} workers"
            limit = (
                f"the driver: needs {cores[0]:.2f}-{cores[1]:.2f} cores ({chunk}; {where})"
                if cores[1] > 1
                else f"none: {cores[0]:.3f}-{cores[1]:.3f} of a driver core ({chunk}; {where})"
            )
            out.append(
                {
                    "workload": w.name,
                    "gpus": gpus,
                    "term": "driver CPU per step",
                    "variant": "at the fastest `nccl` step above",
                    "bytes": None,
                    "total_s": _pair(df["total_s"], ds["total_s"]),
                    "exposed_s": _pair(df["exposed_s"], ds["exposed_s"]),
                    "step_x": _pair(
                        max(best_step[0], df["total_s"]) / w.compute_s, max(best_step[1], ds["total_s"]) / w.compute_s
                    ),
                    "first_limit": limit,
                }
            )
        blocked = (w.state_bytes / fast["ckpt_d2h"], w.state_bytes / slow["ckpt_d2h"])
        write = (w.state_bytes / fast["ckpt_write"], w.state_bytes / slow["ckpt_write"])
        out.append(
            {
                "workload": w.name,
                "gpus": "any",
                "term": "checkpoint (rank 0)",
                "variant": "blocked: device -> host copy; write in the background",
                "bytes": w.state_bytes,
                "total_s": write,
                "exposed_s": blocked,
                "step_x": None,
                "per": " a checkpoint",
                "first_limit": (
                    f"per checkpoint, not per step: the write ({_fmt_s(*write)}) must end before the next one"
                ),
            }
        )
    return out


def table(rs: list[dict[str, Any]]) -> str:
    lines = [
        "| workload | GPUs | term | variant | bytes/GPU | time | exposed per step | step / compute | first limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        step_x = "-"
        if r["step_x"] is not None:
            d = 2 if r["step_x"][1] < 10 else 1
            a, b = f"{r['step_x'][0]:.{d}f}", f"{r['step_x'][1]:.{d}f}"
            step_x = f"{a}x" if a == b else f"{a}-{b}x"
        lines.append(
            f"| {r['workload']} | {r['gpus']} | {r['term']} | {r['variant']} | "
            f"{'-' if r['bytes'] is None else _fmt_bytes(r['bytes'])} | {_fmt_s(*r['total_s'])} | "
            f"{_fmt_s(*r['exposed_s'])}{r.get('per', '')} | {step_x} | {r['first_limit']} |"
        )
    return "\n".join(lines)


def measure_sum(mb: int = 64, reps: int = 20) -> float:
    """Bytes/s of np.add(a, b, out=a) on float32 arrays of ``mb`` MB, one thread, median."""
    import numpy as np

    n = mb * MiB // 4
    a, b = np.ones(n, np.float32), np.ones(n, np.float32)
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        np.add(a, b, out=a)
        times.append(time.perf_counter() - t)
    return n * 4 / sorted(times)[reps // 2]


# Bytes a parameter holds at a step's peak on each GPU, AdamW, bf16 autocast over float32 master parameters (as
# raympi trains): P parameters, G gradients, S the optimizer state (Adam's two moments), N ranks.
MEMORY_MODELS = {
    "unsharded": lambda n: 4 + 4 + 8,  # P + G + S; the step donates: no second copy
    "shard_optimizer, as built": lambda n: 4 + 4 + 4 + 8 / n + 8 / n + 4 / n,
    # peak, as the gradients are packed: P + the free flat buffer (the reduce-scatter's, then the new P's) + G,
    # plus S / N, the slice of the state before last (the step writes into it) and the summed gradient chunk
    "shard_optimizer + buddy copies (fit's default), as built": lambda n: 4 + 4 + 4 + 8 / n * 3 + 4 / n * 3,
    # as above, plus the copy of another rank's S / N, its summed gradient chunk and its parameters' chunk (the
    # copy's update writes into a clone of them)
    "shard_optimizer + overlap (gradients shed per bucket)": lambda n: 4 + 4 + 20 / n,
    # P + the new P of the all-gather; no whole G ever (the buckets are reduce-scattered as backward makes them)
}
ACTIVATION_SHARE = 0.25  # of the GPU's memory kept for activations, NCCL's buffers and the allocator's slack


def memory_rows(gpu_gb: float = 80.0, worlds: tuple[int, ...] = (8, 64)) -> list[dict[str, Any]]:
    """The largest model (parameters) whose training state fits on ``gpu_gb`` GPUs at each world size."""
    room = gpu_gb * 1e9 * (1 - ACTIVATION_SHARE)
    return [
        {"layout": name, "gpus": n, "bytes_per_param": per(n), "max_params_B": room / per(n) / 1e9}
        for name, per in MEMORY_MODELS.items()
        for n in worlds
    ]


def memory_table() -> str:
    lines = [
        "| layout | GPUs x 80 GB | bytes/parameter at the peak | largest model |",
        "|---|---:|---:|---:|",
    ]
    lines += [
        f"| {r['layout']} | {r['gpus']} | {r['bytes_per_param']:.2f} | {r['max_params_B']:.1f} B |"
        for r in memory_rows()
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print rows and constants as JSON")
    parser.add_argument("--measure", action="store_true", help="also time np.add of float32 on this machine")
    parser.add_argument("--quick", action="store_true", help="the same (the model is instant)")
    args = parser.parse_args()
    rs = rows()
    if args.json:
        print(
            json.dumps(
                {
                    "constants": {k: {"fast": v[0], "slow": v[1], "source": v[2]} for k, v in CONST.items()},
                    "workloads": [dataclasses.asdict(w) for w in WORKLOADS],
                    "rows": rs,
                },
                indent=1,
            )
        )
    else:
        print(table(rs))
        print()
        print(memory_table())
        print(
            "(shard_optimizer moves the bytes of one allreduce per step, a reduce-scatter and an all-gather: "
            "its communication time is the NCCL rows' above)\n"
        )
        for w in WORKLOADS:
            print(
                f"- {w.name}: compute {w.compute_s * 1e3:.0f} ms/step, "
                f"backward {w.compute_s * w.backward_frac * 1e3:.0f} ms ({w.note})"
            )
    if args.measure:
        print(
            f"\nnp.add float32, 64 MB, this machine: {measure_sum() / 1e9:.1f} GB/s "
            f"(sum_rate's fast end: {CONST['sum_rate'][0] / 1e9:.1f})"
        )


if __name__ == "__main__":
    main()
