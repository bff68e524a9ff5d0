"""overlap=True: gradient buckets summed while backward runs give the same training as the plain step.

In one process against a recording :class:`BucketSync` (bit for bit), then over real MPI ranks
(Ray actors) with :class:`raympi.comm.buckets.BucketAllreduce`, inline and on its reduction thread.
"""

from __future__ import annotations

import sys
import threading
import time
import types

import pytest
import ray.cloudpickle as cloudpickle
import torch
import torch.nn.functional as F
from torch import nn

from raympi import comm
from raympi.comm.buckets import BucketAllreduce
from raympi.core import optim
from raympi.core.overlap import FIRST_BUCKET_BYTES, plan_buckets
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from raympi.exceptions import CollectiveAborted, ConfigError

torch.set_num_threads(1)
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks cannot import tests/


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 600), nn.ReLU(), nn.Linear(600, 64), nn.ReLU(), nn.Linear(64, 5))


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 5),
    )


MODELS = {"mlp": mlp, "cnn": cnn}


def _batch(step: int, rank: int, n: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 5, (n,), generator=g)


class Recorder:
    """A one-process BucketSync: the sum over one rank is the bucket itself; records what it is given."""

    def __init__(self, bucket_bytes: int = 4096) -> None:
        self.bucket_bytes = bucket_bytes
        self.started: list[torch.Tensor] = []
        self.finished = self.abandoned = 0

    def start(self, bucket: torch.Tensor) -> None:
        self.started.append(bucket)

    def finish(self) -> None:
        self.finished += 1

    def abandon(self) -> None:
        self.abandoned += 1


# --------------------------------------------------------------------------- one process


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("precision, accumulate", [("fp32", 1), ("fp32", 3), ("bf16", 2), ("fp16", 2)])
def test_same_as_plain_step_bit_for_bit(model, precision, accumulate):
    net = MODELS[model]()
    opt = optim.adam(1e-2)
    plain = make_train_step(
        net, F.cross_entropy, opt, grad_sync=lambda tree: None, precision=precision, accumulate=accumulate
    )
    sync = Recorder()
    over = make_train_step(
        net, F.cross_entropy, opt, grad_sync=sync, precision=precision, accumulate=accumulate, overlap=True
    )
    a = b = TrainState.create(net, opt)
    for step in range(4):
        a, ma = plain(a, _batch(step, 0))
        b, mb = over(b, _batch(step, 0))
        assert ma == mb
    for part in ("params", "buffers", "opt_state"):
        for x, y in zip(
            torch.utils._pytree.tree_leaves(getattr(a, part)), torch.utils._pytree.tree_leaves(getattr(b, part))
        ):
            assert torch.equal(x, y), part
    # Per step: the buckets in reverse parameter order, then the statistics row (float64) last.
    per_step = len(sync.started) // 4
    names = plan_buckets(dict(net.named_parameters()), sync.bucket_bytes)
    assert per_step == len(names) + 1 and sync.finished == 4 and sync.abandoned == 0
    assert sync.started[per_step - 1].dtype == torch.float64
    last = dict(net.named_parameters())[names[0][0]]
    assert names[0][0] == list(dict(net.named_parameters()))[-1] and sync.started[0].numel() >= last.numel()


def test_buckets_reverse_order_small_first_one_dtype_each():
    params = {
        "a": torch.zeros(300_000),
        "b": torch.zeros(10, dtype=torch.float64),
        "c": torch.zeros(100_000),
        "d": torch.zeros(100_000),
        "e": torch.zeros(400_000),
    }
    plan = plan_buckets(params, bucket_bytes=2 * 2**20)
    assert plan == [["e"], ["d", "c"], ["b"], ["a"]]
    assert 400_000 * 4 > FIRST_BUCKET_BYTES  # a tensor larger than the cap is a bucket of its own


def test_unused_parameter_and_tied_weights():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.emb = nn.Linear(8, 8, bias=False)
            self.unused = nn.Linear(3, 3)
            self.head = nn.Linear(8, 5)

        def forward(self, x):
            return self.head(x.flatten(1)[:, :8] @ self.emb.weight @ self.emb.weight.t())

    net = Net()
    opt = optim.sgd(0.1, momentum=0.9)
    plain = make_train_step(net, F.cross_entropy, opt, grad_sync=lambda tree: None, accumulate=2)
    over = make_train_step(net, F.cross_entropy, opt, grad_sync=Recorder(), accumulate=2, overlap=True)
    a = b = TrainState.create(net, opt)
    for step in range(3):
        a, _ = plain(a, _batch(step, 0))
        b, _ = over(b, _batch(step, 0))
    for k in a.params:
        assert torch.equal(a.params[k], b.params[k]), k


def test_a_failing_backward_abandons_the_buckets_and_keeps_the_state():
    class Boom(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("boom in backward")

    net = mlp()
    sync = Recorder(bucket_bytes=1024)
    step = make_train_step(
        net, lambda out, y: F.cross_entropy(Boom.apply(out), y), optim.sgd(0.1), grad_sync=sync, overlap=True
    )
    state = TrainState.create(net, optim.sgd(0.1))
    with pytest.raises(RuntimeError, match="boom in backward"):
        step(state, _batch(0, 0))
    assert sync.abandoned == 1 and sync.finished == 0
    assert int(state.step) == 0


def test_overlap_needs_a_bucket_sync_and_no_compression():
    with pytest.raises(ConfigError, match="overlap=True needs a grad_sync with bucket_bytes, start, finish"):
        make_train_step(mlp(), F.cross_entropy, optim.sgd(0.1), grad_sync=lambda tree: None, overlap=True)
    with pytest.raises(ConfigError, match="overlap=True does not combine with compression='bf16'"):
        BucketAllreduce(types.SimpleNamespace(compression="bf16", bucket_bytes=1024))
    # One process (no grad_sync): nothing to overlap, the plain step.
    make_train_step(mlp(), F.cross_entropy, optim.sgd(0.1), overlap=True)


# --------------------------------------------------------------------------- real MPI ranks


def _rank_class(ray):
    @ray.remote(num_cpus=0)
    class Rank(comm.Member):
        def train(
            self,
            model: str,
            overlap: bool,
            thread: bool | None,
            precision: str,
            accumulate: int,
            steps: int,
            bucket_bytes: int,
        ) -> dict[str, torch.Tensor]:
            torch.set_num_threads(1)
            net, opt = MODELS[model](), optim.adamw(1e-2)
            self.comm.bucket_bytes = bucket_bytes
            sync = BucketAllreduce(self.comm, thread=thread) if overlap else self.comm.allreduce_
            step = make_train_step(
                net,
                F.cross_entropy,
                opt,
                grad_sync=sync,
                rank=self.comm.rank,
                donate=True,
                precision=precision,
                accumulate=accumulate,
                overlap=overlap,
            )
            state = TrainState.create(net, opt)
            state = state.replace(
                params={k: v.clone() for k, v in state.params.items()},
                buffers={k: v.clone() for k, v in state.buffers.items()},
            )
            world = self.comm.size
            losses = []
            for i in range(steps):
                # uneven local batches: rank r holds 10 + 2r samples
                state, metrics = step(
                    state, _batch(i, self.comm.rank, 10 + 2 * self.comm.rank), sum(10 + 2 * r for r in range(world))
                )
                losses.append(metrics["loss"])
            return {"params": state.params, "buffers": state.buffers, "losses": losses}

        def aborted_step(self, thread: bool | None, stall_s: float) -> str:
            """Rank 0 steps while the others stall: the driver's abort must get it out, state untouched."""
            torch.set_num_threads(1)
            if self.comm.rank != 0:
                time.sleep(stall_s)
                return "stalled"
            net, opt = mlp(), optim.sgd(0.1)
            self.comm.bucket_bytes = 4096
            step = make_train_step(
                net, F.cross_entropy, opt, grad_sync=BucketAllreduce(self.comm, thread=thread), overlap=True
            )
            state = TrainState.create(net, opt)
            before = {k: v.clone() for k, v in state.params.items()}
            self.comm.abort.clear()
            threading.Timer(0.5, self.comm.abort.set).start()
            try:
                step(state, _batch(0, 0))
            except CollectiveAborted as exc:
                assert all(torch.equal(before[k], state.params[k]) for k in before)
                return f"aborted: {exc}"
            return "finished?"

    return Rank


@pytest.fixture(scope="module")
def ranks(ray_session, spawn):
    return spawn(_rank_class(ray_session), 3)


@pytest.mark.parametrize(
    "model, precision, accumulate, world",
    [
        ("mlp", "fp32", 1, 2),
        ("cnn", "fp32", 1, 3),
        ("mlp", "bf16", 2, 2),
        ("cnn", "bf16", 2, 2),
        ("cnn", "fp16", 1, 2),
    ],
)
def test_overlapped_ranks_train_like_the_plain_allreduce(ray_session, ranks, model, precision, accumulate, world):
    peers = ranks[:world]
    comm.form(peers, timeout_s=60)
    bucket_bytes = 16 * 1024  # several buckets per model
    runs = {}
    for name, overlap, thread in (("plain", False, None), ("inline", True, False), ("thread", True, True)):
        runs[name] = ray_session.get(
            [p.train.remote(model, overlap, thread, precision, accumulate, 5, bucket_bytes) for p in peers], timeout=120
        )
    for name in ("inline", "thread"):
        for rank in range(world):
            ours, ref = runs[name][rank], runs["plain"][rank]  # BatchNorm statistics are per rank
            assert ours["losses"] == pytest.approx(ref["losses"], rel=1e-6, abs=1e-6)
            for part in ("params", "buffers"):
                for k in ref[part]:
                    torch.testing.assert_close(
                        ours[part][k], ref[part][k], rtol=1e-6, atol=1e-6, msg=f"{name} {part} {k}"
                    )


@pytest.mark.parametrize("thread", [False, True], ids=["inline", "thread"])
def test_abort_gets_a_rank_out_of_an_overlapped_step(ray_session, ranks, thread):
    peers = ranks[:2]
    comm.form(peers, timeout_s=60)
    out = ray_session.get([p.aborted_step.remote(thread, 3.0) for p in peers], timeout=60)
    assert out[0].startswith("aborted: rank 0: collective abandoned"), out


# --------------------------------------------------------------------------- through fit


def test_fit_option_overlap(ray_session, tmp_path):
    """fit(overlap=True) on the workers ends where overlap=False does; with compression it is refused."""
    import raympi

    g = torch.Generator().manual_seed(0)
    data = (torch.randn(96, 1, 8, 8, generator=g), torch.randint(0, 5, (96,), generator=g))
    opts = dict(
        workers=2, batch_size=24, epochs=1, progress=False, optimizer=optim.sgd(0.05, momentum=0.9), accumulate=2
    )
    results = {
        o: raympi.fit(mlp(), data, overlap=o, checkpoint_dir=str(tmp_path / str(o)), **opts) for o in (False, True)
    }
    for k, v in results[False].state.params.items():
        torch.testing.assert_close(results[True].state.params[k], v, rtol=1e-6, atol=1e-6)
    assert [m["loss"] for m in results[True].metrics] == pytest.approx(
        [m["loss"] for m in results[False].metrics], rel=1e-6
    )
    with pytest.raises(ConfigError, match="overlap=True does not combine with compression='bf16'"):
        raympi.fit(mlp(), data, overlap=True, compression="bf16", **opts)
