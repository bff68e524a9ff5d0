"""Layer 3: the Ray actor that is one rank.

A :class:`Worker` holds its rank's model template, ``TrainState``, its data source (arrays or the
user's Dataset, shipped once through Ray's object store and read here; or its part of a Ray Data
stream) and its MPI communicator, and runs a chunk of steps per call: the driver sends only
sample indices.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import os
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np
import ray
import torch

from raympi import comm
from raympi.comm import library
from raympi.comm import process_group
from raympi.comm.buckets import BucketAllreduce
from raympi.core import optim, pytree
from raympi.core.precision import LossScaling
from raympi.core.optim import ShardedState, from_plain, to_plain
from raympi.core.shard import (
    Held,
    ShardLayout,
    SliceLost,
    buddy_distance,
    gather_params,
    plan_reshard,
    reshard_messages,
    reshard_receive,
    reshard_skeleton,
    shard_state,
)
from raympi.core.state import TrainState
from raympi.core.batch import correct_predictions
from raympi.core.step import make_eval_step, make_train_step
from raympi.exceptions import CollectiveAborted
from raympi.worker.checkpoint_io import DirectWriter, Snapshot, StoredState
from raympi.worker.results import ChunkResult, Evaluated, Rejoined, StepTimes, Where
from raympi.worker.sources import ArraySource, DatasetSource, StreamSource, arrays_from_refs

__all__ = ["Worker", "WorkerSpec", "accuracy", "to_tensors"]

EVAL_BATCH = 1024
EXIT_WATCH = "raympi-exit-with-parent"  # the thread that ends a worker whose raylet is gone


def accuracy(outputs: Any, targets: torch.Tensor) -> torch.Tensor:
    """Share of samples whose arg-max output is the target class; NaN where that is no classification."""
    correct = correct_predictions(outputs, targets)
    return torch.tensor(float("nan")) if correct is None else correct.double() / max(1, targets.shape[0])


def to_tensors(dataset: Any, columns: tuple[str, str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Materialize a (small) ``ray.data.Dataset`` as an (inputs, targets) pair of tensors."""
    batch = dataset.take_batch(batch_size=max(1, dataset.count()), batch_format="numpy")
    return tuple(torch.from_numpy(np.array(batch[c])) for c in columns)  # type: ignore[return-value]  # a writable copy


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker is built from; the same for every rank of a run.

    Attributes:
        model: the module (a template: its tensors become the state).
        loss_fn: ``loss_fn(outputs, targets)`` -> mean over the samples given.
        optimizer: a :mod:`raympi.optim` transform.
        train: ``(inputs, targets)``, a tree of object refs of arrays (``train_kind="arrays"``); the
            object ref of a map-style Dataset (``"dataset"``); or ``None`` (``"stream"``: the rank's
            part of a Ray Dataset comes in :meth:`Worker.setup`).
        train_kind: ``"arrays"``, ``"dataset"`` or ``"stream"``.
        eval: the evaluation set, as ``train`` (``"arrays"`` or ``"dataset"``), or ``None``.
        eval_kind: ``"arrays"`` or ``"dataset"``.
        device: ``"cpu"`` or ``"cuda"``.
        torch_threads: torch threads of this worker.
        seed: the run's seed (data augmentation is seeded per sample from it).
        loader_workers: processes reading a Dataset ahead of the step (0: read in the step's thread).
        step_options: more keyword arguments of :func:`~raympi.core.step.make_train_step` (``on_nonfinite``, ...).
        grad_transport: how gradients are summed: ``"mpi"`` (the communicator itself), ``"gloo"`` or
            ``"nccl"`` (a process group built from it, see :mod:`raympi.comm.process_group`).
        fp32_reduce: gloo/NCCL: sum 16-bit gradients in float32.
        shard_buddy: ``shard_optimizer``: keep a copy of another rank's slice (a warm restart then loses none).
        transport_timeout_s: building the process group, and the longest one of its operations may block.
    """

    model: torch.nn.Module
    loss_fn: Callable[..., Any]
    optimizer: Any
    train: Any = None
    train_kind: str = "arrays"
    eval: Any = None
    eval_kind: str = "arrays"
    device: str = "cpu"
    torch_threads: int = 1
    seed: int = 0
    loader_workers: int = 0
    step_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    grad_transport: str = "mpi"
    fp32_reduce: bool = False
    shard_buddy: bool = False
    transport_timeout_s: float = 120.0
    env: dict[str, str] = dataclasses.field(default_factory=dict)


class Worker(comm.Member):
    """One rank: call :meth:`setup` after :func:`raympi.comm.form`, then :meth:`run` chunks of steps."""

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        _apply_env(spec.env)
        torch.set_num_threads(spec.torch_threads)
        self.host = socket.gethostname()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.rank = rank  # the rank this actor will get; Ray tags its printed lines with it (see __repr__)
        self.device = torch.device("cuda", 0) if spec.device == "cuda" else torch.device("cpu")
        self.model = spec.model.to(self.device)
        self.loss_fn = spec.loss_fn
        self.optimizer = spec.optimizer
        self.step_options = spec.step_options
        self.sharded = False  # shard_optimizer over a group of several ranks: set with the communicator (_build_steps)
        self.buddy: int | None = None  # sharded with buddy copies: rank r keeps rank r + buddy's slice too
        self.transport = (spec.grad_transport, spec.fp32_reduce, spec.transport_timeout_s)
        self.shard_buddy = spec.shard_buddy
        self.grad_sync: Any = None  # the step's cross-rank sum, rebuilt for every new communicator
        self.progress = 0  # steps and evaluation batches done: what ping reports, so slow is told from hung
        self.activity = ("idle", time.monotonic())  # what the main thread is doing, since when (where())
        self.at_step = 0  # the step of the state held, counted as steps complete (where())
        # Before MPI starts: a Dataset's loader forks its reading processes here.
        self.source: Any = _source(spec.train, spec.train_kind, spec) if spec.train_kind != "stream" else None
        self.eval_source: Any = (
            _source(spec.eval, spec.eval_kind, spec, loader_workers=0) if spec.eval is not None else None
        )
        self.state: TrainState | None = None
        self.writer = DirectWriter()  # large checkpoints, written from here in the background
        # A spot reclaim sends SIGTERM: note it, finish the chunk, and let the driver take a checkpoint
        # and re-form the group without this rank (it kills us then).
        self.sigterm = False
        if not any(t.name == EXIT_WATCH for t in threading.enumerate()):  # (a reused worker has both already)
            signal.signal(signal.SIGTERM, lambda *_: setattr(self, "sigterm", True))
            _exit_with_parent()

    def park(self) -> bool:
        """Drop this run's model, state, data and gradient transport: the process waits, torch imported, to be
        taken by the next ``fit`` of the same shape (:mod:`raympi.driver.pool`)."""
        self._close_grad_sync()
        for source in (self.source, self.eval_source):
            if source is not None:
                source.close()
        self.writer.wait()
        run = ("grad_sync", "source", "eval_source", "state", "model", "loss_fn", "optimizer", "writer", "train_step")
        self.__dict__.update(dict.fromkeys((*run, "eval_step", "step_options"), None))
        return True

    def _close_grad_sync(self) -> None:
        """End the last communicator's reduction thread or process group, if it has one."""
        if self.grad_sync is not None and hasattr(self.grad_sync, "close"):
            self.grad_sync.close()

    def reuse(self, spec: WorkerSpec, rank: int) -> None:
        """Become a worker of a new run, as a freshly started one would (after :meth:`park`)."""
        self.__init__(spec, rank)  # type: ignore[misc]

    def __repr__(self) -> str:  # Ray tags this actor's printed lines with it
        return f"rank {getattr(self, 'rank', '?')} on {getattr(self, 'host', '?')}"

    def setup(
        self, state: dict[str, Any] | None, seed: int, shard: Any = None, columns: tuple[str, str] | None = None
    ) -> int:
        """Build the step functions over the communicator; start from ``state`` or from the model.

        ``shard``: this rank's stream of a ``ray.data.Dataset`` (``streaming_split``).
        """
        if shard is not None:
            assert columns is not None, "a Ray Dataset's stream comes with its columns"
            self.source = StreamSource(shard, columns)
        assert self.comm is not None and self.comm.rank == self.rank, "form the communicator first"
        self._build_steps()
        scaling = (
            LossScaling() if self.step_options.get("precision") == "fp16" else None
        )  # fp16: the scaler lives in the state
        # Sharded: a stateless placeholder here, then only this rank's slice is initialised (_own).
        placeholder = optim.set_to_zero() if self.sharded else self.optimizer
        state_tree = (
            TrainState.create(self.model, placeholder, seed=seed, loss_scaling=scaling)
            if state is None
            else TrainState.from_dict(
                state.load()
                if isinstance(state, StoredState)  # a large checkpoint on storage
                else pytree.from_arrays(state)
            )
        )  # a checkpoint, or a survivor's snapshot
        if self.sharded:
            state_tree = shard_state(
                state_tree, self.comm.rank, self.comm.size, self.optimizer if state is None else None, self.buddy
            )
        self._own(state_tree)
        return os.getpid()

    def rejoin(self, root: int) -> Rejoined:
        """Warm restart, after a new communicator was formed: take the state of rank ``root`` (a survivor);
        with ``shard_optimizer``, the slices of the optimizer state the survivors hold, re-cut for this group.

        Returns the step of the state now held, or why the survivors' slices do not make a state (every
        rank returns the same).
        """
        self.rank = self.comm.rank
        self.source.drop()  # batches fed for the abandoned steps
        self._build_steps()
        if self.step_options.get("shard_optimizer"):
            return self._reshard(root)
        tree = self.comm.broadcast(self.state.to_dict() if self.rank == root else None, root=root)
        self._own(TrainState.from_dict(tree))
        return Rejoined(int(self.state.step))

    def _reshard(self, root: int) -> Rejoined:
        """:meth:`rejoin` of a sharded state: the parameters from ``root``, and every slice of the optimizer
        state from the member that holds it (its own, or its buddy copy) to the ranks that need it."""
        mine = self.state
        try:
            plan = plan_reshard(self.comm.mpi.allgather(Held.of(mine)))
        except SliceLost as lost:
            return Rejoined(-1, f"{lost}; the run restarts from the newest checkpoint")
        size, base = self.comm.size, None
        if self.rank == root:
            skeleton = reshard_skeleton(self.state.opt_state, self.state.params)
            base = (self.state.replace(opt_state=None).to_dict(), to_plain(skeleton))
        tree, skeleton = self.comm.broadcast(base, root=root)
        params = tree["params"]
        parts = (
            reshard_messages(mine.opt_state, params, plan, self.rank, size, self.buddy)
            if mine is not None
            else [[] for _ in range(size)]
        )
        received = self.comm.mpi.alltoall(parts)
        opt_state = reshard_receive(received, from_plain(skeleton), params, self.rank, size, self.buddy)
        self.state = None  # (the old slices go before the new state's copy is made)
        new = TrainState.from_dict(tree).replace(opt_state=opt_state)
        self._own(new)
        return Rejoined(int(new.step))

    def _build_steps(self) -> None:
        self.comm.mpi.Set_errhandler(library.require().ERRORS_RETURN)  # a lost peer raises instead of aborting us
        options = dict(self.step_options)
        overlap = bool(options.pop("overlap", False))  # gradient buckets summed while backward runs
        # A world of one has nothing to shard: its state stays whole (no slice buffers, no copies).
        self.sharded = options["shard_optimizer"] = bool(options.get("shard_optimizer")) and self.comm.size > 1
        self.buddy = None
        if self.sharded and self.shard_buddy:  # the copy of each slice on another node, where the ranks allow it
            self.buddy = buddy_distance(self.comm.mpi.allgather(ray.get_runtime_context().get_node_id()))
        self._close_grad_sync()
        self.grad_sync = self._grad_sync(overlap)
        self.train_step = make_train_step(
            self.model,
            self.loss_fn,
            self.optimizer,
            grad_sync=self.grad_sync,
            rank=self.rank,
            donate=True,
            overlap=overlap,
            **options,
        )
        fns = {"loss": self.loss_fn, "accuracy": accuracy, **(self.step_options.get("metrics") or {})}
        self.eval_step = make_eval_step(self.model, fns)
        self.eval_step_names = [*fns, "samples"]

    def _grad_sync(self, overlap: bool) -> Any:
        """The cross-rank gradient sum over the current communicator: none in a world of one (nothing
        to sum), the communicator's own MPI path, or a gloo/NCCL process group built from it."""
        transport, fp32_reduce, timeout_s = self.transport
        if self.comm.size == 1:
            return None
        if transport == "mpi":
            if self.sharded:  # the communicator's reduce_scatter, all_gather_ and sum_
                return self.comm
            return BucketAllreduce(self.comm) if overlap else self.comm.allreduce_
        assert self.comm is not None
        return process_group.connect(
            self.comm, transport, ray.util.get_node_ip_address(), timeout_s, fp32_reduce=fp32_reduce
        )

    def _own(self, state: TrainState) -> None:
        # Steps donate the state's memory (update in place), so the state must be this actor's own:
        # what came through Ray may be read-only object-store memory.
        self.state = pytree.map(lambda t: t.to(self.device).clone() if isinstance(t, torch.Tensor) else t, state)
        self.logs_hyperparams = bool(optim.current_hyperparams(self.state.opt_state))  # inject_hyperparams: log them
        self.at_step = int(self.state.step)

    def _to_device(self, batch: Any) -> Any:
        if self.device.type == "cpu":
            return batch
        return pytree.map(
            lambda t: t.pin_memory().to(self.device, non_blocking=True) if isinstance(t, torch.Tensor) else t, batch
        )

    def run(self, steps: list[tuple[int, Any]], global_batch_size: int) -> ChunkResult:
        """Take one step per entry of ``steps``: ``(epoch, this rank's sample indices)``.

        Returns a :class:`~raympi.worker.results.ChunkResult`. A step whose
        collective is abandoned (the driver's :meth:`abort`, or MPI reporting a lost peer) leaves the
        state as it was before that step, and the chunk returns early with ``aborted``.
        """
        history: list[dict[str, Any]] = []
        MPI = library.require()
        aborted = False
        began, waited, data_s = time.monotonic(), self.comm.collective_s, 0.0
        self.source.feed(steps)
        for _ in steps:
            self._doing("data")
            batch = self._to_device(self.source.next())
            data_s += time.monotonic() - self.activity[1]
            self._doing("compute")
            try:
                self.state, metrics = self.train_step(self.state, batch, global_batch_size)
            except (CollectiveAborted, MPI.Exception):
                aborted = True
                self.source.drop()
                break
            self.progress += 1
            self.at_step += 1
            if self.logs_hyperparams:
                metrics.update(optim.current_hyperparams(self.state.opt_state))
            history.append(metrics)
        self._doing("idle")
        collective_s = self.comm.collective_s - waited
        times = StepTimes(data_s, max(0.0, time.monotonic() - began - data_s - collective_s), collective_s)
        self.at_step = int(self.state.step)
        return ChunkResult(history, self.at_step, aborted=aborted, sigterm=self.sigterm, times=times)

    def _doing(self, activity: str) -> None:
        self.activity = (activity, time.monotonic())

    def evaluate(self, index: torch.Tensor, with_ema: bool = False) -> Evaluated:
        """Evaluate this rank's share of the eval set (with the EMA parameters when asked and kept);
        rank 0 returns the global means.  A collective abandoned (a peer failed) is ``aborted``: an
        infrastructure failure, as in :meth:`run`, never the user's error."""
        ema = optim.ema_params(self.state.opt_state) if with_ema else None
        if ema is not None and self.sharded:  # this rank's pieces of the average: gathered into whole tensors
            layout = ShardLayout.of(self.state.params, self.comm.size)
            try:
                ema = gather_params(ema, layout, self.grad_sync)
            except (CollectiveAborted, library.require().Exception):
                return Evaluated(aborted=True)
        state = self._state() if ema is None else self._state().replace(params=ema)
        totals: dict[str, float] = {}
        for chunk in torch.split(index, EVAL_BATCH):
            if len(chunk):
                for k, v in self.eval_step(state, self._to_device(self.eval_source.read(chunk))).items():
                    totals[k] = totals.get(k, 0.0) + v
                self.progress += 1
        names = sorted(self.eval_step_names)  # every rank sends the same sums in the same order, even with no samples
        sums_here = torch.tensor([totals.get(k, 0.0) for k in names], dtype=torch.float64)
        try:
            summed = self.comm.allreduce_([sums_here])[0].tolist()
        except (CollectiveAborted, library.require().Exception):
            return Evaluated(aborted=True)
        if self.rank != 0:
            return Evaluated()
        sums = dict(zip(names, summed))
        samples = max(1.0, sums.pop("samples"))
        # accuracy is NaN where it does not apply (regression): then it is not reported
        return Evaluated({f"eval_{k}": v / samples for k, v in sums.items() if v == v})

    @ray.method(concurrency_group="health")
    def abort(self) -> None:
        """Abandon the collective in flight (a peer failed); the state stays at the last whole step."""
        if self.comm is not None:
            self.comm.abort.set()
        if isinstance(self.grad_sync, process_group.ProcessGroupSum):
            self.grad_sync.abort()  # NCCL: its kernels in flight end now

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """Answered from its own thread even while a step blocks in MPI: silence means a hung process.
        Returns the steps and evaluation batches done so far: a rank that answers but whose count stays
        put is stuck (in a collective, say); one whose count moves is only slow."""
        return self.progress

    @ray.method(concurrency_group="health")
    def where(self) -> Where:
        """Where this rank is now: waiting for data, computing, or waiting in a collective, since when."""
        activity, since = self.activity
        if self.comm is not None and self.comm.in_collective_since:
            activity, since = "collective", self.comm.in_collective_since
        return Where(self.at_step, activity, time.monotonic() - since)

    @ray.method(concurrency_group="health")
    def node(self) -> str:
        """The Ray node this worker runs on."""
        return self.node_id

    @ray.method(concurrency_group="health")
    def stacks(self) -> str:
        """Every thread's Python stack now (``faulthandler``), answered even while the step is stuck."""
        with tempfile.TemporaryFile("w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            return f.read()

    @ray.method(concurrency_group="health")
    def snapshot(self) -> dict[str, Any]:
        """:meth:`state_dict` from the health thread, while the main one may be blocked re-forming."""
        return self.state_dict()

    def checkpoint(self, folder: str, min_bytes: int, name: str = "state.pt") -> Snapshot:
        """The state for a checkpoint: of at least ``min_bytes``, copied and written into ``folder`` (a
        temporary folder the driver made) in the background, so that training waits only for the copy;
        otherwise (or when ``folder`` is not visible here) in the answer, for the driver to write.

        ``name``: the file; with ``shard_optimizer`` every rank writes its own (``shard-00000.pt`` ...): its
        slice of the optimizer state, and on rank 0 the rest of the state."""
        state = self._stored()
        if self.rank and name != "state.pt":  # the parameters and buffers are rank 0's to write
            state = state.replace(params={}, buffers={})
        snapshot = self.writer.start(state.to_dict(), folder, min_bytes, name)
        if snapshot.folder is None:
            snapshot.arrays = self.state_dict()
        return snapshot

    @ray.method(concurrency_group="health")
    def checkpoint_status(self, folder: str) -> dict[str, Any]:
        """How the background write into ``folder`` goes (see :meth:`DirectWriter.status`)."""
        return self.writer.status(folder)

    def state_dict(self) -> dict[str, Any]:
        """This rank's state as plain CPU tensors (what a checkpoint holds).

        The tensors go as numpy arrays (:func:`raympi.core.pytree.to_arrays`: one copy into the object store).
        On CPU they are the live ones; Ray serializes the return value before the next step runs.
        """
        arrays: dict[str, Any] = pytree.to_arrays(_tree_to(self._stored(), torch.device("cpu")).to_dict())
        return arrays

    def _state(self) -> TrainState:
        """The state held (a worker has one from :meth:`setup` on)."""
        assert self.state is not None, "no state before setup"
        return self.state

    def _stored(self) -> TrainState:
        """The state as a checkpoint holds it: without the buddy copy of another rank's slice (its owner sends it)."""
        state = self._state()
        if isinstance(state.opt_state, ShardedState) and state.opt_state.buddy:
            state = state.replace(opt_state=state.opt_state._replace(buddy=()))
        return state


# glibc's mallopt parameters of the MALLOC_*_ environment variables (malloc.h)
_MALLOPT = {"MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_MMAP_THRESHOLD_": -3, "MALLOC_ARENA_MAX": -8}


def _apply_env(env: dict[str, str]) -> None:
    """Take the group's environment now, before MPI starts (it reads its variables then): into
    ``os.environ`` (MPI, forked loader processes), and glibc's malloc settings through ``mallopt``
    (glibc reads the variables only when a process starts)."""
    os.environ.update(env)
    settings = {_MALLOPT[k]: int(v) for k, v in env.items() if k in _MALLOPT}
    if not settings:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: its variables mean nothing here
        return
    for param, value in settings.items():
        libc.mallopt(param, value)


def _exit_with_parent(period_s: float = 0.5) -> None:
    """Exit once the process that started this one (Ray's raylet) is gone.

    Ray's own worker outlives a raylet that was killed (measured: still there after minutes), and
    then no ``ray.kill`` reaches it, since its node is dead to Ray: an orphan holding memory, or a GPU.
    """
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        os._exit(1)

    threading.Thread(target=watch, name=EXIT_WATCH, daemon=True).start()


def _source(data: Any, kind: str, spec: WorkerSpec, loader_workers: int | None = None) -> Any:
    if kind == "arrays":  # in Ray's object store: ray.get maps them zero-copy, shared per node
        return ArraySource(arrays_from_refs(data))
    dataset = ray.get(data) if isinstance(data, ray.ObjectRef) else data
    return DatasetSource(dataset, spec.seed, spec.loader_workers if loader_workers is None else loader_workers)


def _tree_to(state: TrainState, device: torch.device) -> TrainState:
    moved: TrainState = pytree.map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, state)
    return moved
