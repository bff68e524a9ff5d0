"""``raympi.fit``: the driver's entry point.

Validates the options and the dataset before any actor starts, connects to Ray, ships the data
once through the object store, and hands the run to the :class:`~raympi.driver.controller.Controller`
(which owns the data cursor, checkpoints and restarts).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Literal, NoReturn

import ray
import torch

from raympi.comm import library
from raympi.core import optim, pytree
from raympi.core.loss import default_loss
from raympi.core.precision import LossScaling, cpu_has_native_bf16
from raympi.core.shard import ShardLayout, init_opt_state
from raympi.core.state import TrainState
from raympi.core.step import make_train_step
from raympi.driver import data, local_ray, report, tune
from raympi.driver.capacity import worker_bundle
from raympi.driver.checkpoint import CheckpointStore
from raympi.driver.config import UNSET, FitConfig, MPIConfig, parse_config
from raympi.driver.controller import Controller
from raympi.driver.pipeline import ChunkPlan, Pipeline
from raympi.driver.report import read_metrics
from raympi.driver.run_state import Checkpoint, History, RunState
from raympi.exceptions import ConfigError, MPIUnavailableError, TrainingError
from raympi.worker import WorkerSpec, to_tensors
from raympi.worker.checkpoint_io import StoredState

__all__ = ["fit", "Result"]


@dataclasses.dataclass
class Result:
    """What :func:`fit` returns.

    Attributes:
        state: the final :class:`~raympi.TrainState` (CPU tensors).
        model: the user's module with the trained weights loaded.
        metrics: one record per step (step, epoch, loss, accuracy, samples_per_s,
            world_size, time) plus eval metrics where they were taken.  The steps a warm restart learnt of from the
            survivors (finished, not yet reported when a rank failed) carry ``reconstructed: True`` and no
            ``samples_per_s``.
        checkpoint: the folder of the last checkpoint written (the newest, which ``resume=True`` continues from).
        best_checkpoint: with ``checkpoint_metric``, the folder of the kept checkpoint with its best value (of
            equal ones the newer; load it with :func:`raympi.load_checkpoint`); ``None`` without the option, or
            where no checkpoint had a value for the metric (then a warning says so).
        ema: the parameter average kept by :func:`raympi.optim.ema` (load it with
            ``model.load_state_dict(result.ema, strict=False)``), or ``None``.
        restarts: one record per recovery or planned re-formation (empty when none happened): time,
            step, ranks, nodes, cause, kind, phase, path (warm/cold), world size before/after, steps
            lost, restored step, recovery_s.
    """

    state: TrainState
    model: torch.nn.Module
    metrics: list[dict[str, Any]]
    checkpoint: str | None
    restarts: list[dict[str, Any]]
    ema: dict[str, torch.Tensor] | None = None
    best_checkpoint: str | None = None


def fit(
    model: torch.nn.Module,
    dataset: Any,
    workers: int = 1,
    *,
    # length and batch
    epochs: int = 1,
    max_steps: int | None = None,
    batch_size: int = 64,
    seed: int = 0,
    # model and optimization
    optimizer: optim.GradientTransformation | None = None,
    loss_fn: Callable[..., Any] | None = None,
    metrics: Mapping[str, Callable[..., Any]] = UNSET,
    precision: Literal["fp32", "bf16", "fp16"] = "fp32",
    accumulate: int = 1,
    on_nonfinite: Literal["raise", "skip"] = "raise",
    shard_optimizer: bool = False,
    shard_buddy: bool = True,
    # data
    columns: tuple[str, str] | None = None,
    loader_workers: int | None = None,
    torch_threads: int | None = None,
    # evaluation
    eval_dataset: Any = None,
    eval_every: int = 0,
    eval_with_ema: bool = False,
    # checkpoints
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 3,
    checkpoint_metric: str | None = None,
    checkpoint_mode: Literal["min", "max"] | None = None,
    direct_checkpoint_bytes: int | None = 2**30,
    resume: bool = False,
    # cluster and placement
    address: str | None = None,
    use_gpu: bool | None = None,
    resources_per_worker: Mapping[str, float] = UNSET,
    placement_strategy: Literal["SPREAD", "PACK", "STRICT_SPREAD", "STRICT_PACK"] = "SPREAD",
    keep_workers: bool = UNSET,
    # fault tolerance
    min_workers: int | None = None,
    max_restarts: int = 3,
    spares: int | None = None,
    startup_timeout_s: float = 120.0,
    step_timeout_s: float = 10.0,
    restart_timeout_s: float = 60.0,
    straggler_factor: float | None = 3.0,
    straggler_chunks: int = 4,
    # communication
    grad_transport: Literal["auto", "mpi", "nccl", "gloo"] = "auto",
    bucket_bytes: int = 16 * 2**20,
    overlap: bool | None = None,
    compression: Literal["bf16", "fp16"] | None = None,
    fp32_reduce: bool = False,
    mpi: MPIConfig = UNSET,
    # reporting
    progress: bool | None = None,
    callbacks: Sequence[Any] = UNSET,
    **unknown: NoReturn,
) -> Result:
    """Train ``model`` on ``dataset`` data-parallel over ``workers`` Ray actors joined by MPI.

    The options follow ``workers`` as keyword-only parameters, grouped as on the options page of the guide, which
    explains each; :class:`~raympi.driver.config.FitConfig` validates them (and describes each) before any actor
    starts. A default of :data:`~raympi.driver.config.UNSET` is made when ``fit`` runs.

    - length and batch: ``epochs``, ``max_steps``, ``batch_size`` (the global batch, split over the ranks),
      ``seed``;
    - model and optimization: ``optimizer`` (a :mod:`raympi.optim` transform; default ``raympi.optim.adam(1e-3)``),
      ``loss_fn`` (default: the model's own loss, else cross-entropy), ``metrics``, ``precision``, ``accumulate``,
      ``on_nonfinite``, ``shard_optimizer``, ``shard_buddy``;
    - data: ``columns``, ``loader_workers``, ``torch_threads``;
    - evaluation: ``eval_dataset``, ``eval_every``, ``eval_with_ema``;
    - checkpoints: ``checkpoint_dir``, ``checkpoint_every``, ``keep_checkpoints`` (the newest, or with
      ``checkpoint_metric`` the best by it, lower or higher as ``checkpoint_mode`` says, and the newest),
      ``direct_checkpoint_bytes``, ``resume``;
    - cluster and placement: ``address``, ``use_gpu``, ``resources_per_worker`` (default ``{"CPU": 1}``),
      ``placement_strategy``, ``keep_workers`` (default: the environment variable ``RAYMPI_KEEP_WORKERS=1``);
    - fault tolerance: ``min_workers``, ``max_restarts``, ``spares``, ``startup_timeout_s``, ``step_timeout_s``,
      ``restart_timeout_s``, ``straggler_factor``, ``straggler_chunks``;
    - communication: ``grad_transport``, ``bucket_bytes``, ``overlap``, ``compression``, ``fp32_reduce``, ``mpi``
      (default ``MPIConfig()``);
    - reporting: ``progress``, ``callbacks``.

    Args:
        model: the ``nn.Module`` to train; it is copied to every worker and receives the trained weights.
        dataset: a map-style ``torch.utils.data.Dataset`` of ``(input, target)`` pairs, or an
            ``(inputs, targets)`` tuple of tensors or arrays.
        workers: the number of ranks (one Ray actor each).
        **unknown: no option: a name that is none of the above is a :class:`~raympi.exceptions.ConfigError` that
            lists the known options (typed ``NoReturn``, so that a type checker reports it too).

    Returns:
        A :class:`Result`.

    Raises:
        ConfigError: a bad option or dataset, before any actor starts.
        CapacityError: the cluster cannot host the workers within ``startup_timeout_s``.
        TrainingError: the model, loss or data failed on a worker (with its traceback).

    Example:
        >>> result = raympi.fit(Net(), (images, labels), workers=2, epochs=1, batch_size=64)  # doctest: +SKIP
        >>> result.metrics[-1]["loss"]  # doctest: +SKIP
    """
    given = dict(locals())  # the parameters alone, as nothing else is bound yet
    options = {name: given[name] for name in FitConfig.model_fields if given[name] is not UNSET}
    return _fit(model, dataset, parse_config(**options, **unknown))


def _fit(model: torch.nn.Module, dataset: Any, cfg: FitConfig) -> Result:
    """:func:`fit` once its options are validated; it reads them from ``cfg`` only (a parameter of ``fit`` such
    as ``grad_transport`` would hide the function of that name here)."""
    slots = tune.in_trial(cfg.workers)
    if slots is not None:
        cfg = _in_trial(cfg, slots)
    reason = library.problem()
    if reason:
        raise MPIUnavailableError(reason)
    optimizer = cfg.optimizer or optim.adam(1e-3)
    if cfg.shard_optimizer:  # what the workers would refuse, refused here (on the meta device: no memory)
        make_train_step(model, cfg.loss_fn or default_loss, optimizer, shard_optimizer=True)
        trainable = {n: torch.empty_like(p, device="meta") for n, p in model.named_parameters() if p.requires_grad}
        init_opt_state(optimizer, trainable, ShardLayout.of(trainable, cfg.workers), 0)
    loss_fn = cfg.loss_fn or default_loss
    stop_ray: Callable[[], None] | None = None  # set where this fit starts Ray itself
    ray_dataset, train = None, None
    sample: Any  # (inputs, targets) or a dict of inputs, to try a step on; None where not read on the driver
    announce = report.Announcer(cfg.progress)
    if _is_ray_dataset(dataset):
        stop_ray = _connect_ray(cfg)  # a Ray Dataset needs Ray to be read
        announce("counting the Ray Dataset's rows")
        columns = data.columns_of(dataset, cfg.columns)
        ray_dataset = (dataset, columns)
        num_samples = dataset.count()
        if num_samples == 0:
            raise ConfigError("dataset is empty: it has no samples to train on")
        sample = to_tensors(dataset.limit(2), columns)
    else:
        train = data.inspect(dataset)
        num_samples, sample = train.length, train.value if train.kind == "arrays" else None
    eval_data = data.inspect(cfg.eval_dataset, "eval_dataset") if cfg.eval_dataset is not None else None
    worlds = range(cfg.min_workers or cfg.workers, cfg.workers + 1)  # (FitConfig sets min_workers)
    sampler = data.Sampler(cfg.seed, cfg.batch_size, num_samples, worlds, sharded=ray_dataset is not None)
    if sample is not None:  # a Dataset is never read on the driver: its first step checks it
        _dry_run(model, loss_fn, optimizer, sample, cfg)
    root = cfg.checkpoint_dir or os.path.join("runs", "raympi-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    if slots is not None:  # Tune copies checkpoints from paths it gets later, perhaps from another directory
        root = os.path.abspath(root) if "://" not in root else root
        if tune.restore_into(root):  # Tune hands the trial a checkpoint: continue from it
            cfg = cfg.model_copy(update={"resume": True})
    store = CheckpointStore(
        root,
        cfg.keep_checkpoints,
        fetch_timeout_s=cfg.startup_timeout_s,
        direct_bytes=cfg.direct_checkpoint_bytes,
        metric=cfg.checkpoint_metric,
        mode=cfg.checkpoint_mode or "min",
    )
    if not ray.is_initialized():
        announce("starting Ray" if not (cfg.address or os.environ.get("RAY_ADDRESS")) else "connecting to Ray")
    stop_ray = _connect_ray(cfg) or stop_ray
    try:
        if stop_ray is not None:  # (and shut down at the end: no worker outlives this fit)
            cfg = _fit_local_cores(cfg, announce).model_copy(update={"keep_workers": False})
        announce("shipping the data to the object store")
        use_gpu = cfg.use_gpu if cfg.use_gpu is not None else ray.cluster_resources().get("GPU", 0) >= 1
        if cfg.precision == "bf16" and not use_gpu and not cpu_has_native_bf16():
            announce.warn(
                "precision='bf16' on a CPU without native bfloat16 (no AVX512-BF16 or AMX): torch emulates it, "
                "measured 6-8x slower than fp32; precision='fp32' is faster on this machine"
            )
        spec = WorkerSpec(
            model=model,
            loss_fn=loss_fn,
            optimizer=optimizer,
            train=data.ship(train) if train else None,
            train_kind=train.kind if train else "stream",
            eval=data.ship(eval_data) if eval_data else None,
            eval_kind=eval_data.kind if eval_data else "arrays",
            device="cuda" if use_gpu else "cpu",
            seed=cfg.seed,
            loader_workers=_loader_workers(cfg),
            step_options={**_step_options(cfg), "overlap": _overlaps(cfg, use_gpu)},
            torch_threads=cfg.torch_threads or max(1, int(cfg.resources_per_worker.get("CPU", 1))),
            grad_transport=grad_transport(cfg, use_gpu),
            fp32_reduce=cfg.fp32_reduce,
            shard_buddy=cfg.shard_optimizer and cfg.shard_buddy,
            transport_timeout_s=cfg.startup_timeout_s,
        )
        spe = sampler.steps_per_epoch
        plan = ChunkPlan(
            total=min(spe * cfg.epochs, cfg.max_steps or spe * cfg.epochs),
            steps_per_epoch=spe,
            checkpoint_every=cfg.checkpoint_every,
            eval_every=cfg.eval_every,
            has_eval=eval_data is not None,
        )
        fingerprint = {
            "batch_size": cfg.batch_size,
            "seed": cfg.seed,
            "num_samples": num_samples,
            "params": {name: list(p.shape) for name, p in model.named_parameters()},
            "frozen": sorted(n for n, p in model.named_parameters() if not p.requires_grad),
            "optimizer_state": _optimizer_layout(optimizer, model),
        }
        run = _resumed(store, fingerprint) if cfg.resume else RunState()
        # Without a buddy copy, a lost rank's slice of a sharded optimizer state is lost with it.
        warm = ray_dataset is None and (cfg.shard_buddy or not cfg.shard_optimizer)
        run = dataclasses.replace(run, warm_possible=warm)
        pipeline = Pipeline(
            plan,
            sampler,
            cfg,
            eval_data.length if eval_data else 0,
            snapshot=(
                (lambda group, step: store.request_shards(group.actors, step))
                if cfg.shard_optimizer
                else (lambda group, step: store.request(group.actors[0], step))
            ),
        )
        final = Controller(cfg, spec, pipeline, store, run, ray_dataset, announce, fingerprint).fit()
        # The driver's copy may be read-only object-store memory: hand the user tensors of their own.
        # A large state was written by rank 0 and never came here: it is read from storage now, once.
        newest = final.newest
        assert newest is not None, "a run that ends well has written its last checkpoint"
        kept = newest.state
        kept = kept.load() if isinstance(kept, StoredState) else kept
        state = pytree.map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, TrainState.from_dict(kept))
        model.load_state_dict({**state.params, **state.buffers}, strict=False)
        return Result(
            state=state,
            model=model,
            metrics=list(final.history),
            checkpoint=newest.path,
            restarts=[r.as_dict() for r in final.restarts],
            ema=optim.ema_params(state.opt_state),
            best_checkpoint=store.best(),
        )
    finally:
        store.close()
        if stop_ray is not None:
            stop_ray()


def _step_options(cfg: FitConfig) -> dict[str, Any]:
    """The options of :func:`~raympi.core.step.make_train_step` that ``fit`` passes through."""
    return {
        "on_nonfinite": cfg.on_nonfinite,
        "precision": cfg.precision,
        "accumulate": cfg.accumulate,
        "metrics": dict(cfg.metrics),
        "shard_optimizer": cfg.shard_optimizer,
    }


def _overlaps(cfg: FitConfig, use_gpu: bool) -> bool:
    """``overlap`` as set; by default on with GPUs (the host idles while they compute), off on CPUs (it did not pay)."""
    if cfg.overlap is not None:
        return cfg.overlap
    return bool(use_gpu) and cfg.compression is None and not cfg.shard_optimizer


def grad_transport(cfg: FitConfig, use_gpu: bool) -> str:
    """The gradient transport of the run: as set, else NCCL for workers with a whole GPU each and MPI
    otherwise (on CPUs MPI beat gloo; NCCL refuses two ranks on one GPU).

    Raises:
        ConfigError: ``"nccl"`` for workers without a GPU.
    """
    if cfg.grad_transport == "nccl" and not use_gpu:
        raise ConfigError(
            "grad_transport='nccl' needs GPU workers, and the cluster has no GPU (or use_gpu is off): "
            "use grad_transport='gloo' or 'mpi' on CPUs"
        )
    if cfg.grad_transport != "auto":
        return cfg.grad_transport
    return "nccl" if use_gpu and worker_bundle(cfg, True)["GPU"] >= 1 and cfg.compression is None else "mpi"


def _loader_workers(cfg: FitConfig) -> int:
    """Reading processes per worker: as set, else one per CPU the worker has beyond the one it computes on."""
    if cfg.loader_workers is not None:
        return cfg.loader_workers
    return min(4, max(0, int(cfg.resources_per_worker.get("CPU", 1)) - 1))


def _in_trial(cfg: FitConfig, slots: tune.TrialSlots) -> FitConfig:
    """Inside a Tune trial: the workers take the trial's bundles (no spares beyond them), and the run
    reports to the trial."""
    return cfg.model_copy(
        update={
            "resources_per_worker": dict(slots.bundle),
            "use_gpu": bool(slots.bundle.get("GPU")),
            "spares": 0,
            "callbacks": [*cfg.callbacks, tune.TuneReport(cfg.checkpoint_every, _eval_names(cfg))],
        }
    )


def _eval_names(cfg: FitConfig) -> tuple[str, ...]:
    """The metrics an evaluation reports (accuracy only where it applies, so not promised here)."""
    if cfg.eval_dataset is None:
        return ()
    return ("eval_loss", *(f"eval_{name}" for name in cfg.metrics))


def _fit_local_cores(cfg: FitConfig, announce: Any) -> FitConfig:
    """On a Ray instance fit started itself, more workers than cores run oversubscribed (fractional CPUs)."""
    cpus = ray.cluster_resources().get("CPU", 1)
    per = cfg.resources_per_worker.get("CPU", 1)
    if cfg.use_gpu or cfg.workers * per <= cpus:
        return cfg
    share = cpus / cfg.workers
    announce.warn(
        f"{cfg.workers} workers on {cpus:g} CPU(s): running them oversubscribed ({share:.2g} CPU each), "
        "so each step is slower than on enough cores"
    )
    return cfg.model_copy(update={"resources_per_worker": {**cfg.resources_per_worker, "CPU": share}})


def _resumed(store: CheckpointStore, fingerprint: dict[str, Any]) -> RunState:
    """The run state of the newest valid checkpoint, or a fresh one when there is none.

    Raises:
        ConfigError: the checkpoint was made with a global batch, seed, dataset length or model that
            differs from this run's: its step would mean other samples (each difference is named).
    """
    found = store.latest(stored_from=store.direct_bytes)  # a large state stays on storage: the workers read it
    if found is None:
        return RunState()
    path, manifest, state = found
    saved = manifest.get("run")
    if saved is not None and _differences(saved, fingerprint):
        raise ConfigError(
            f"resume=True: the checkpoint {path} was made by a different run: "
            + "; ".join(_differences(saved, fingerprint))
            + ". Resume with the same values, or pass a new checkpoint_dir to start afresh"
        )
    step = int(manifest["step"])
    if "history" in manifest:  # written before metrics.jsonl was appended (raympi <= 0.1's manifests)
        records = [r for r in manifest["history"] if r["step"] <= step]
    else:
        records = read_metrics(store.file("metrics.jsonl"), store.fs, until=step)
    return RunState(step=step, start_step=step, history=History.of(records), newest=Checkpoint(step, path, state))


def _differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = [
        f"{key} was {saved.get(key)}, now {now[key]}"
        for key in ("batch_size", "seed", "num_samples")
        if saved.get(key) != now[key]
    ]
    before, after = saved.get("params", {}), now["params"]
    out += [f"parameter {n!r} is new" for n in after if n not in before]
    out += [f"parameter {n!r} is gone" for n in before if n not in after]
    out += [
        f"parameter {n!r} was of shape {before[n]}, now {after[n]}"
        for n in after
        if n in before and before[n] != after[n]
    ]
    if saved.get("frozen", now["frozen"]) != now["frozen"]:  # (these two keys are absent from older checkpoints)
        out.append(f"the frozen parameters (requires_grad=False) were {saved['frozen']}, now {now['frozen']}")
    was, now_opt = saved.get("optimizer_state"), now["optimizer_state"]
    if None not in (was, now_opt) and was != now_opt:
        out.append(
            f"the optimizer state was {json.dumps(was)}, now {json.dumps(now_opt)} (another optimizer, or one "
            "with other state; a new learning rate or schedule is fine, unless inject_hyperparams keeps it in the "
            "state)"
        )
    return out


def _optimizer_layout(optimizer: Any, model: torch.nn.Module) -> Any:
    """The layout of ``optimizer``'s fresh state for ``model``, per-parameter dicts folded, as JSON values;
    built on the meta device (no memory).  ``None`` where the optimizer cannot be initialised there."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    try:
        state = optimizer.init({n: torch.empty_like(p, device="meta") for n, p in trainable.items()})
    except Exception:
        return None

    def layout(x: Any) -> Any:
        if isinstance(x, tuple) and hasattr(
            x, "_fields"
        ):  # a state NamedTuple: its fields, as older manifests have them
            x = dict(zip(x._fields, x))
        if isinstance(x, dict) and x and set(x) <= set(trainable):  # one entry per parameter: which ones, not each
            return "per parameter" if len(x) == len(trainable) else {"per parameter": sorted(x)}
        if isinstance(x, dict):
            return {str(k): layout(v) for k, v in x.items()}
        if isinstance(x, (tuple, list)):
            return [layout(v) for v in x]
        return list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__

    return layout(state)


def _is_ray_dataset(dataset: Any) -> bool:
    return type(dataset).__module__.startswith("ray.data") and hasattr(dataset, "split")


def _dry_run(
    model: torch.nn.Module,
    loss_fn: Callable[..., Any],
    optimizer: optim.GradientTransformation,
    sample: Any,
    cfg: FitConfig,
) -> None:
    """One step on two in-memory samples in the driver: a data/model mismatch is caught before any actor starts.

    ``sample``: ``(inputs, targets)`` tensors, or a dict of inputs alone."""
    step = make_train_step(model, loss_fn, optimizer, **_step_options(cfg))
    two = pytree.map(lambda t: t[:2], sample)
    scaling = LossScaling() if cfg.precision == "fp16" else None
    try:
        step(TrainState.create(model, optimizer, seed=cfg.seed, loss_scaling=scaling), two)
    except TrainingError:
        raise
    except Exception as exc:
        shapes = pytree.map(lambda t: f"{tuple(t.shape)} {t.dtype}", two)
        seen = f"inputs {shapes}" if isinstance(shapes, dict) else f"inputs {shapes[0]}, targets {shapes[1]}"
        raise TrainingError(
            f"the dataset's items do not fit the model or the loss: a step on two samples ({seen}) "
            f"raised {type(exc).__name__}: {exc}"
        ) from exc


def _connect_ray(cfg: FitConfig) -> Callable[[], None] | None:
    """Join the configured cluster, or start a private local instance (:mod:`raympi.driver.local_ray`);
    returns what stops Ray where we started it."""
    if ray.is_initialized():
        return None
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, logging_level=logging.ERROR)
        return None
    return local_ray.start()
