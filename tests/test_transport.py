"""grad_transport: gradients summed over a gloo process group built from the MPI communicator.

The NCCL transport is the same code on CUDA tensors (``tools/gpu_check.py`` runs it where a
GPU is lent); gloo runs the whole torch.distributed path here: the rendezvous over MPI, the tree
and bucket paths, overlap, abort and a rebuild on a new communicator.  In one process (a world of
one over ``COMM_SELF``), across real MPI ranks (Ray actors), and through ``fit``.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import ray.cloudpickle as cloudpickle
import torch
import torch.nn.functional as F
from torch import nn

import raympi
from raympi import comm
from raympi.comm import process_group
from raympi.comm.buckets import BucketAllreduce
from raympi.core import optim
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from raympi.exceptions import CollectiveAborted, ConfigError

torch.set_num_threads(1)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import tests/


def net(frozen: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 6 * 6, 64),
        nn.ReLU(),
        nn.Linear(64, 5),
    )
    if frozen:
        model[0].weight.requires_grad_(False)
    return model


def _batch(step: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 1, 8, 8, generator=g)
    return x, torch.randint(0, 5, (n,), generator=g)


# --------------------------------------------------------------------------- one process, a world of one


@pytest.fixture(scope="module")
def self_comm():
    from raympi.comm import library
    from raympi.comm.communicator import Communicator

    return Communicator(library.init().COMM_SELF.Dup(), bucket_bytes=4096)


def test_a_tree_is_summed_in_place_with_shapes_and_dtypes_kept(self_comm):
    sync = process_group.connect(self_comm, "gloo", "127.0.0.1", timeout_s=30)
    tree = {
        "grads": {
            "a": torch.arange(6.0).view(2, 3),
            "big": torch.ones(70_000),
            "h": torch.ones(3, dtype=torch.bfloat16),
        },
        "stats": torch.tensor([1.0, 2.0], dtype=torch.float64),
    }
    before = {k: v.clone() for k, v in tree["grads"].items()}
    assert sync(tree) is None
    for k, v in tree["grads"].items():  # a sum over one rank is the tensor itself
        assert v.dtype == before[k].dtype and v.shape == before[k].shape and torch.equal(v, before[k])
    assert tree["stats"].tolist() == [1.0, 2.0]
    sync.close()


@pytest.mark.parametrize("fp32_reduce, wire", [(False, torch.bfloat16), (True, torch.float32)])
def test_16bit_gradients_travel_in_their_own_dtype_unless_fp32_reduce(self_comm, fp32_reduce, wire):
    sync = process_group.connect(self_comm, "gloo", "127.0.0.1", timeout_s=30, fp32_reduce=fp32_reduce)
    bucket = torch.full((10,), 1.5, dtype=torch.bfloat16)
    sync.start(bucket)
    assert sync._pending[0].wire.dtype == wire
    sync.finish()
    assert bucket.dtype == torch.bfloat16 and bucket.tolist() == [1.5] * 10
    sync.close()


def test_a_set_abort_flag_refuses_new_buckets(self_comm):
    sync = process_group.connect(self_comm, "gloo", "127.0.0.1", timeout_s=30)
    self_comm.abort.set()
    try:
        with pytest.raises(CollectiveAborted, match="abandoned"):
            sync.start(torch.ones(4))
    finally:
        self_comm.abort.clear()
    sync.close()


def test_an_unknown_transport_is_refused(self_comm):
    with pytest.raises(ConfigError, match="grad_transport must be one of"):
        process_group.connect(self_comm, "nccl2", "127.0.0.1")


# --------------------------------------------------------------------------- real ranks (Ray actors)


def _rank_class(ray):
    @ray.remote(num_cpus=0)
    class Rank(comm.Member):
        def train(
            self, transport: str, overlap: bool, precision: str, accumulate: int, frozen: bool, steps: int = 4
        ) -> dict:
            torch.set_num_threads(1)
            self.comm.bucket_bytes = 8 * 1024  # several buckets
            model = net(frozen)
            if frozen:  # and a masked optimizer: weight decay on matrices only
                opt = optim.adamw(1e-2, weight_decay=0.1, mask=lambda p: {n: t.ndim >= 2 for n, t in p.items()})
            else:
                opt = optim.sgd(0.05, momentum=0.9)
            sync = (
                process_group.connect(self.comm, transport, "127.0.0.1", timeout_s=30)
                if transport != "mpi"
                else BucketAllreduce(self.comm)
                if overlap
                else self.comm.allreduce_
            )
            step = make_train_step(
                model,
                F.cross_entropy,
                opt,
                grad_sync=sync,
                rank=self.comm.rank,
                donate=True,
                precision=precision,
                accumulate=accumulate,
                overlap=overlap,
            )
            state = TrainState.create(model, opt, loss_scaling=raympi.LossScaling() if precision == "fp16" else None)
            state = state.replace(
                params={k: v.clone() for k, v in state.params.items()},
                buffers={k: v.clone() for k, v in state.buffers.items()},
            )
            world, out = self.comm.size, []
            for i in range(steps):
                x, y = _batch(i, self.comm.rank, 8 + 2 * self.comm.rank)  # uneven local batches
                if precision == "fp16" and i == 1 and self.comm.rank == world - 1:
                    x = x * 6e4  # this rank's fp16 gradients overflow: every rank must skip the step
                state, metrics = step(state, (x, y), sum(8 + 2 * r for r in range(world)))
                out.append(metrics)
            if hasattr(sync, "close"):
                sync.close()
            return {"params": state.params, "buffers": state.buffers, "metrics": out}

        def stalled_step(self, stall_s: float) -> str:
            """Rank 0 steps over gloo while the others stall: an abort gets it out, its state untouched."""
            torch.set_num_threads(1)
            sync = process_group.connect(self.comm, "gloo", "127.0.0.1", timeout_s=20)
            if self.comm.rank != 0:
                time.sleep(stall_s)
                self.stale = sync  # (kept: its peer's sum is still in flight)
                return "stalled"
            model, opt = net(), optim.sgd(0.1)
            step = make_train_step(model, F.cross_entropy, opt, grad_sync=sync, overlap=True)
            state = TrainState.create(model, opt)
            before = {k: v.clone() for k, v in state.params.items()}
            threading.Timer(0.5, self.comm.abort.set).start()
            started = time.monotonic()
            try:
                step(state, _batch(0, 0, 8))
            except CollectiveAborted as exc:
                assert all(torch.equal(before[k], state.params[k]) for k in before)
                sync.close()
                return f"aborted after {time.monotonic() - started:.2f} s: {exc}"
            return "finished?"

    return Rank


@pytest.fixture(scope="module")
def ranks(ray_session, spawn):
    return spawn(_rank_class(ray_session), 3)


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    for part in ("params", "buffers"):
        for k in b[part]:
            torch.testing.assert_close(a[part][k], b[part][k], rtol=tol, atol=tol, msg=f"{part} {k}")
    assert [m["loss"] for m in a["metrics"]] == pytest.approx(
        [m["loss"] for m in b["metrics"]], rel=tol, abs=tol, nan_ok=True
    )


@pytest.mark.parametrize(
    "world, overlap, precision, accumulate, frozen",
    [
        (2, False, "fp32", 1, False),
        (3, True, "fp32", 1, False),
        (3, False, "fp32", 4, False),
        (2, True, "fp32", 4, True),
        (2, True, "bf16", 1, False),
        (3, False, "bf16", 2, True),
        (2, False, "fp16", 1, False),
        (3, True, "fp16", 2, False),
    ],
)
def test_gloo_ranks_train_like_mpi(ray_session, ranks, world, overlap, precision, accumulate, frozen):
    peers = ranks[:world]
    comm.form(peers, timeout_s=60)
    args = (overlap, precision, accumulate, frozen)
    runs = {t: ray_session.get([p.train.remote(t, *args) for p in peers], timeout=120) for t in ("mpi", "gloo")}
    for rank in range(world):  # BatchNorm statistics are per rank
        _close(runs["gloo"][rank], runs["mpi"][rank])
    if precision == "fp16":  # the overflow on one rank was seen by all: the scale agreed and step 2 skipped
        for rank in range(world):
            assert [m["skipped"] for m in runs["gloo"][rank]["metrics"]] == [0, 1, 0, 0]
            assert len({m["loss_scale"] for m in runs["gloo"][rank]["metrics"][2:]}) == 1


def test_an_abort_gets_a_rank_out_of_a_gloo_sum_and_a_new_group_trains(ray_session, ranks):
    peers = ranks[:2]
    comm.form(peers, timeout_s=60)
    out = ray_session.get([p.stalled_step.remote(3.0) for p in peers], timeout=60)
    assert out[0].startswith("aborted after") and "collective abandoned" in out[0], out
    assert float(out[0].split()[2]) < 2.0, out  # the flag is seen within POLL_S, not at gloo's timeout
    comm.form(peers, timeout_s=60)  # a new communicator, a new process group over it
    again = ray_session.get([p.train.remote("gloo", True, "fp32", 1, False, 2) for p in peers], timeout=60)
    assert all(len(r["metrics"]) == 2 for r in again)


# --------------------------------------------------------------------------- through fit


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(192, 1, 8, 8, generator=g)
    return x, (x[:, 0, 0, 0] > 0).long()


def mlp() -> nn.Module:  # no BatchNorm: its statistics depend on the split, the documented exception
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))


def test_fit_over_gloo_ends_where_mpi_does_with_1_2_and_3_workers(ray_session, tmp_path):
    opts = dict(batch_size=24, epochs=1, progress=False, optimizer=optim.sgd(0.05, momentum=0.9))
    ref = raympi.fit(mlp(), _data(), workers=2, grad_transport="mpi", checkpoint_dir=str(tmp_path / "mpi"), **opts)
    for workers in (2, 1, 3):  # 2 first: it takes the processes the reference kept (integration tier)
        got = raympi.fit(
            mlp(), _data(), workers=workers, grad_transport="gloo", checkpoint_dir=str(tmp_path / f"g{workers}"), **opts
        )
        for k, v in ref.state.params.items():
            torch.testing.assert_close(got.state.params[k], v, rtol=1e-5, atol=1e-5, msg=f"{workers} workers: {k}")
        assert len(got.metrics) == len(ref.metrics) == 8


def test_fit_refuses_transport_options_that_cannot_work():
    data = _data()
    with pytest.raises(ConfigError, match="compression='bf16' applies to the MPI transport only"):
        raympi.fit(net(), data, grad_transport="gloo", compression="bf16")
    with pytest.raises(ConfigError, match="grad_transport='nccl' needs GPU workers"):
        raympi.fit(net(), data, grad_transport="nccl", use_gpu=False)
    with pytest.raises(ConfigError, match="a whole GPU per worker"):
        raympi.fit(net(), data, grad_transport="nccl", use_gpu=True, resources_per_worker={"CPU": 1, "GPU": 0.5})
    with pytest.raises(ConfigError, match="grad_transport: Input should be"):
        raympi.fit(net(), data, grad_transport="tcp")


def test_auto_picks_nccl_only_for_workers_with_a_whole_gpu():
    from raympi.driver.config import parse_config
    from raympi.driver.fit import grad_transport

    assert grad_transport(parse_config(), use_gpu=False) == "mpi"
    assert grad_transport(parse_config(), use_gpu=True) == "nccl"
    assert grad_transport(parse_config(resources_per_worker={"CPU": 1, "GPU": 0.5}), use_gpu=True) == "mpi"
    assert grad_transport(parse_config(compression="bf16"), use_gpu=True) == "mpi"
    assert grad_transport(parse_config(grad_transport="gloo"), use_gpu=True) == "gloo"
    with pytest.raises(ConfigError, match="needs GPU workers"):
        grad_transport(parse_config(grad_transport="nccl"), use_gpu=False)
