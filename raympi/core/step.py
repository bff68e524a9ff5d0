"""``make_train_step``: training as a pure function of a ``TrainState``.

The heart of the functional core.  ``train_step(state, batch)`` runs the
model with ``torch.func.functional_call`` on the state's tensors, takes the
gradient with ``torch.autograd.grad`` on detached leaf views of the
parameters (the same gradients, bit for bit, as ``torch.func.grad_and_value``,
which wraps exactly this call in a transform layer: measured 15% slower per
step here, and its first call imports ``torch._dynamo``, 1.5-3 s of every
worker's start), hands it to ``grad_sync`` (the
worker layer plugs the MPI allreduce in there; ``None`` in one process),
applies the optimizer and returns a *new* state: the input is never touched
(unless the caller donates it, see ``make_train_step(donate=True)``).

A step is a few parts, each a function of the static ``_Setup`` that
``make_train_step`` checked: ``_inputs`` (the batch and state checks, the
micro-batches), ``_gradients`` (the micro-batch loop, ``_micro_grad`` each),
``_sync`` (the one cross-rank sum, unless the buckets summed during backward),
``_read`` (fp16's unscale and the step's one host read) and ``_update`` (the
optimizer step, or a skipped one).

The global-batch rule: the loss of a step is the mean over the samples of the
*global* batch.  Each rank scales its local mean loss by
``local_n / global_batch_size`` and the ranks' gradients are summed, so any
split of one global batch over any number of ranks gives the same update up
to floating-point summation order.  Mixed precision lives in
:mod:`~raympi.core.precision`, micro-batching in
:mod:`~raympi.core.accumulate`, the statistics in :mod:`~raympi.core.metrics`;
``make_eval_step`` (:mod:`~raympi.core.evaluate`) is re-exported here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Literal, Optional, cast

import torch
from torch import nn

from raympi.core.accumulate import MicroBatch, check_accumulate, micro_batches
from raympi.core.batch import Batch, call_model, split_batch
from raympi.core.evaluate import make_eval_step
from raympi.core.metrics import (
    RESERVED,
    MetricFn,
    Metrics,
    StatsLayout,
    StepStats,
    check_metric_names,
    read_stats,
    stats_row,
)
from raympi.core.mode import in_mode
from raympi.core.optim import GradientTransformation, ShardedState, apply_gradients
from raympi.core.overlap import Buckets, BucketSync
from raympi.core.precision import (
    LossScaling,
    Precision,
    autocast,
    check_precision,
    next_loss_scale,
    nonfinite_flag,
    unscale_,
)
from raympi.core.rng import seed_generators, step_seed
from raympi.core.shard import (
    ShardBuffers,
    ShardLayout,
    ShardSync,
    apply_sharded,
    check_shardable,
    next_gradients,
    reduce_gradients,
)
from raympi.core.state import TrainState
from raympi.exceptions import ConfigError, NonFiniteLossError, TrainingError

__all__ = ["make_train_step", "make_eval_step"]

LossFn = Callable[[Any, Optional[torch.Tensor]], torch.Tensor]  # targets: None for a batch of inputs alone
GradSync = Callable[[Any], Any]


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0 or not loss.is_floating_point():
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else repr(type(loss))
        raise TrainingError(
            f"loss_fn must return a floating-point scalar (0-d tensor), the MEAN loss "
            f"over the samples it is given; it returned {got}. Use reduction='mean' "
            f"(the default of torch.nn.functional losses) or end it with .mean()."
        )


def _trainable(model: nn.Module) -> list[str]:
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    if not names:
        raise ConfigError(
            f"{type(model).__name__} has no trainable parameter (none with requires_grad=True): "
            "there is nothing to train. Register the weights as nn.Parameter and do not freeze all."
        )
    return names


def make_train_step(
    model: nn.Module,
    loss_fn: LossFn,
    optimizer: GradientTransformation,
    *,
    grad_sync: Optional[GradSync] = None,
    on_nonfinite: Literal["raise", "skip"] = "raise",
    rank: int = 0,
    donate: bool = False,
    precision: Precision = "fp32",
    loss_scaling: Optional[LossScaling] = None,
    accumulate: int = 1,
    metrics: Optional[dict[str, MetricFn]] = None,
    overlap: bool = False,
    shard_optimizer: bool = False,
) -> Callable[..., tuple[TrainState, Metrics]]:
    """Build ``train_step(state, batch, global_batch_size=None) -> (new_state, metrics)``.

    The model is only a template: its own tensors are never read or written
    (``functional_call`` substitutes the state's).  It runs in train mode: a model
    in eval mode is switched for the step, while a module set to eval inside a
    training model (a frozen BatchNorm) stays in eval; modes are restored after.

    ``batch`` is ``(inputs, targets)`` or ``{"inputs": ..., "targets": ...}``;
    ``inputs`` is a tensor (``model(inputs)``), a tuple (``model(*inputs)``)
    or a dict (``model(**inputs)``); ``targets`` is a tensor, first dimension
    the batch.  ``global_batch_size`` is the sample count of the whole step
    over all ranks; it defaults to this batch's size (one process).

    ``grad_sync``, when given, is called once per step (whatever
    ``accumulate``) with the tree ``{"grads": {name: tensor}, "stats":
    float64 tensor [loss * n, correct, n, n_targets, metric * n for each of
    ``metrics``, then with fp16 a 0/1 "this rank's gradients overflowed"
    flag]}`` (the row :class:`~raympi.core.metrics.StatsLayout` describes)
    and must return the leaf-wise SUM over the ranks (a new tree of
    this rank's own tensors, or ``None`` after summing in place).  Riding the
    statistics on the gradient allreduce makes the metrics global at no extra
    collective.

    Metrics are Python numbers, already global: ``"loss"`` (mean over the
    global batch), ``"samples"``, each of ``metrics`` (its global mean) and,
    when the targets are integer class ids for outputs shaped ``(N, C, ...)``,
    ``"accuracy"``.  With fp16 also ``"loss_scale"`` (the scale this step
    used) and ``"skipped"`` (0 or 1); with ``on_nonfinite="skip"``,
    ``"nonfinite"`` (bool) and ``"skipped"``.

    Dropout and other random layers are seeded per step from
    ``(state.rng_seed, state.step, rank)`` inside ``torch.random.fork_rng``,
    so a step is reproducible and the process's global RNG is left alone.

    Args:
        model: the ``nn.Module`` whose forward is used.
        loss_fn: ``loss_fn(outputs, targets) -> scalar``, the MEAN over the
            samples it is given (``F.cross_entropy``'s default); the step
            rescales it to the global batch.
        optimizer: a :class:`raympi.optim.GradientTransformation`.
        grad_sync: the cross-rank sum, or ``None`` in one process.
        on_nonfinite: on a NaN/inf global loss, ``"raise"``
            :class:`~raympi.exceptions.NonFiniteLossError`, or ``"skip"`` the
            update (the new state differs only by ``step + 1``).  Decided on
            the global loss, so every rank decides alike.
        rank: this rank's index, folded into the dropout seed so that ranks
            draw different masks.
        donate: let each step write the new parameters and optimizer state
            into the memory of the input state's (JAX's buffer donation), for
            loops of the form ``state, m = train_step(state, batch)`` that
            never touch an old state again: no second copy of the parameters
            and optimizer state.  The input state is then garbage:
            do not keep it and do not donate tensors you do not own, such as
            read-only buffers from Ray's object store.  Off by default:
            ``train_step`` is then pure.
        precision: ``"fp32"``; ``"bf16"`` or ``"fp16"`` run the forward pass
            and the loss under ``torch.autocast`` on the parameters' device
            (master weights and optimizer stay float32).  ``"fp16"`` adds
            dynamic loss scaling with ``torch.amp.GradScaler``'s rules, its
            state in ``state.loss_scale``: a step whose summed gradients hold
            an inf/NaN on any rank is skipped (parameters and optimizer state
            unchanged, so the optimizer's own count and schedules do not
            advance; ``state.step`` does, as a training loop's step does
            around ``GradScaler.step``; the forward's BatchNorm statistics
            are kept when the loss was finite), reported as ``"skipped": 1``
            and the scale backed off.  Such a step is the scaler's business:
            ``on_nonfinite`` is not consulted.
        loss_scaling: fp16 only: the scaler's settings,
            :class:`~raympi.core.precision.LossScaling` (GradScaler's defaults).
        accumulate: split each rank's batch into this many micro-batches
            (``torch.tensor_split`` on dim 0, uneven allowed) and sum their
            gradients before the one ``grad_sync``: the update equals the
            unaccumulated one up to rounding (except through BatchNorm,
            which sees micro-batches), with a micro-batch's activation memory.
        metrics: name -> ``fn(outputs, targets) -> scalar tensor``, the MEAN
            over the samples it is given; reported as the global-batch mean.
            ``"accuracy"`` replaces the automatic one; the step's own keys
            are reserved.
        overlap: sum the gradients over the ranks while backward runs (DDP's buckets, see
            :mod:`~raympi.core.overlap`; with ``accumulate`` the last micro-batch's backward).
            ``grad_sync`` must then be a :class:`~raympi.core.overlap.BucketSync` (``None``: no effect).
        shard_optimizer: keep only this rank's slice of the optimizer state and of the summed
            gradients (ZeRO-2, :mod:`~raympi.core.shard`): a reduce-scatter of the gradients, the
            optimizer on this rank's slice, an all-gather of the parameters.  ``grad_sync`` must then
            be a :class:`~raympi.core.shard.ShardSync` (``None``: a world of one); the state's
            ``opt_state`` becomes a :class:`~raympi.optim.ShardedState` (an unsharded one is cut on
            the first step).  Equal to the unsharded step up to summation order.

    Returns:
        ``train_step``, a pure function of ``(state, batch, global_batch_size)``
        (unless ``donate``).

    Raises:
        ConfigError: no trainable parameter, or a bad ``on_nonfinite``,
            ``precision``, ``loss_scaling``, ``accumulate`` or metric name; ``shard_optimizer``
            with ``overlap``, with a ``grad_sync`` that cannot reduce-scatter, or with parameters
            of several dtypes.

    Example:
        >>> step = make_train_step(model, F.cross_entropy, raympi.optim.sgd(0.1),
        ...                        precision="bf16", accumulate=4)
        >>> state = TrainState.create(model, raympi.optim.sgd(0.1))
        >>> state, metrics = step(state, (x, y))
        >>> metrics["loss"], metrics["accuracy"], metrics["samples"]
    """
    if on_nonfinite not in ("raise", "skip"):
        raise ConfigError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    check_precision(precision, loss_scaling)
    scaler = (loss_scaling or LossScaling()) if precision == "fp16" else None
    accumulate = check_accumulate(accumulate)
    metric_fns = dict(metrics or {})
    layout = StatsLayout(tuple(check_metric_names(metric_fns, RESERVED, "metrics")), overflow_flags=bool(scaler))
    trainable = frozenset(_trainable(model))
    overlapped = overlap and grad_sync is not None
    if shard_optimizer:
        check_shardable({n: p for n, p in model.named_parameters() if n in trainable})
        if overlapped:
            raise ConfigError(
                "shard_optimizer=True cannot be combined with overlap=True yet (the buckets would be "
                "all-reduced, not reduce-scattered): set overlap=False"
            )
        if grad_sync is not None and not all(
            hasattr(grad_sync, a) for a in ("reduce_scatter", "all_gather_", "sum_", "shift_")
        ):
            raise ConfigError(
                "shard_optimizer=True needs a grad_sync with reduce_scatter, all_gather_, sum_ and shift_ "
                "(raympi.core.shard.ShardSync: the MPI communicator or a gloo/NCCL process group)"
            )
    if overlapped and not isinstance(grad_sync, BucketSync):
        raise ConfigError(
            "overlap=True needs a grad_sync with bucket_bytes, start, finish and abandon "
            "(raympi.core.overlap.BucketSync, e.g. raympi.comm.buckets.BucketAllreduce)"
        )
    setup = _Setup(
        model=model,
        loss_fn=loss_fn,
        optimizer=optimizer,
        grad_sync=grad_sync,
        on_nonfinite=on_nonfinite,
        rank=rank,
        donate=donate,
        precision=precision,
        scaler=scaler,
        accumulate=accumulate,
        metric_fns=metric_fns,
        overlapped=overlapped,
        layout=layout,
        trainable=trainable,
        shard=shard_optimizer,
        buffers=ShardBuffers() if shard_optimizer and donate else None,
        mutable=frozenset(n for n, _ in model.named_buffers()),  # frozen parameters are never written
    )

    def train_step(
        state: TrainState, batch: Batch, global_batch_size: Optional[int] = None
    ) -> tuple[TrainState, Metrics]:
        micros, global_n = _inputs(setup, state, batch, global_batch_size)
        # A state from before fp16 (or made without loss_scaling) starts the scaler here.
        loss_scale = (state.loss_scale or scaler.init()) if scaler else state.loss_scale
        scale = float(loss_scale["scale"]) if scaler else 1.0
        # The forward writes running statistics into the buffers it is given:
        # give it copies so the input state stays as it was.
        buffers = {k: (v.clone() if k in setup.mutable else v) for k, v in state.buffers.items()}
        grads, stats, classify = _gradients(setup, state, buffers, micros, global_n, scale)
        copied: dict[str, torch.Tensor] = {}  # the buddy's pieces of the sums, where this rank keeps its copy
        if setup.shard:  # this rank's pieces of the sums; the statistics are summed in _read
            grads, stats, copied = _sync_shards(setup, grads, stats, state.opt_state)
        elif not overlapped:  # (overlapped, the buckets have summed both already)
            grads, stats = _sync(setup, grads, stats)
        read = _read(setup, grads, stats, scale, classify, copied)
        if global_batch_size is not None and read.metrics["samples"] != global_n:
            raise TrainingError(
                f"the ranks' batches hold {read.metrics['samples']} samples in all but global_batch_size is "
                f"{global_n}: pass the size of the whole step's batch over all ranks"
            )
        return _update(setup, state, buffers, grads, read, loss_scale, scale, copied)

    return train_step


# --------------------------------------------------------------------------- the step's parts


@dataclasses.dataclass(frozen=True)
class _Setup:
    """What ``make_train_step`` fixed, checked: the static half of every step (its arguments as documented there)."""

    model: nn.Module
    loss_fn: LossFn
    optimizer: GradientTransformation
    grad_sync: Optional[GradSync]
    on_nonfinite: str
    rank: int
    donate: bool
    precision: Precision
    scaler: Optional[LossScaling]  # fp16's loss scaling, else None
    accumulate: int
    metric_fns: dict[str, MetricFn]
    overlapped: bool  # the sum runs in buckets during the last backward
    layout: StatsLayout  # the statistics row
    trainable: frozenset[str]  # the names state.params must have
    shard: bool  # shard_optimizer: this rank's slice of the sums and of the optimizer state
    buffers: Optional[ShardBuffers]  # shard_optimizer with donate: the memory its steps write into again
    mutable: frozenset[str]  # the real buffers: the forward pass may write them


def _inputs(
    setup: _Setup, state: TrainState, batch: Batch, global_batch_size: Optional[int]
) -> tuple[list[MicroBatch], int]:
    """Check the batch and the state; return the micro-batches and the global batch size."""
    args, kwargs, targets, n = split_batch(batch)
    if set(state.params) != setup.trainable:
        raise TrainingError(
            "state.params does not match the model's trainable parameters: missing "
            f"{sorted(setup.trainable - set(state.params))}, unexpected "
            f"{sorted(set(state.params) - setup.trainable)}. Build it with TrainState.create(model, ...)."
        )
    global_n = n if global_batch_size is None else int(global_batch_size)
    return micro_batches(args, kwargs, targets, n, setup.accumulate), global_n


def _micro_grad(
    setup: _Setup,
    params: dict[str, torch.Tensor],
    buffers: dict[str, torch.Tensor],
    micro: MicroBatch,
    factor: float,
    device_type: str,
    watch: Optional[Callable[[dict[str, torch.Tensor]], None]] = None,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, bool]:
    """``(gradients, stats row, classify)`` of one micro-batch's loss times ``factor``; ``params`` is not touched.

    ``watch`` sees the parameter leaves before the forward pass (overlap's hooks).
    """
    args, kwargs, targets, n = micro
    leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
    if watch is not None:
        watch(leaves)
    with torch.enable_grad():
        with autocast(setup.precision, device_type):
            outputs = call_model(setup.model, (leaves, buffers), args, kwargs)
            loss = setup.loss_fn(outputs, targets)
        _check_loss(loss)
        with torch.no_grad():
            row, classify = stats_row(loss, outputs, targets, n, setup.metric_fns, setup.layout)
        # Differentiate this batch's share of the global mean, times the loss scale;
        # in float32 at least, as GradScaler does: an fp16 loss times 2**16 overflows.
        scaled = loss.to(torch.promote_types(loss.dtype, torch.float32)) * factor
        if scaled.requires_grad:
            grads = torch.autograd.grad(scaled, list(leaves.values()), materialize_grads=True)
        else:  # a loss that does not depend on the parameters
            grads = tuple(torch.zeros_like(v) for v in leaves.values())
    return dict(zip(leaves, grads)), row, classify


def _gradients(
    setup: _Setup,
    state: TrainState,
    buffers: dict[str, torch.Tensor],
    micros: list[MicroBatch],
    global_n: int,
    scale: float,
) -> tuple[dict[str, torch.Tensor], torch.Tensor, bool]:
    """The micro-batch loop: this rank's gradients and statistics row, summed over its micro-batches.

    Runs the model in train mode with the step's own random streams.  With ``overlapped`` the last
    micro-batch's backward also sums over the ranks (buckets), so what comes back is already the global sum.

    Returns:
        ``(grads, stats, classify)``.
    """
    device_type = next(iter(state.params.values())).device.type
    cuda = sorted({t.device.index or 0 for t in state.params.values() if t.device.type == "cuda"})
    with in_mode(setup.model, True), torch.random.fork_rng(devices=cuda):
        seed_generators(step_seed(int(state.rng_seed), int(state.step), setup.rank), cuda)
        grads = stats = None
        for i, micro in enumerate(micros):
            factor = micro[3] / global_n * scale
            if setup.overlapped and i == len(micros) - 1:  # the last backward sums its buckets as it goes
                # make_train_step let overlapped through only with a BucketSync.
                with Buckets(state.params, cast(BucketSync, setup.grad_sync), grads, bool(setup.scaler)) as buckets:
                    g, row, classify = _micro_grad(
                        setup, state.params, buffers, micro, factor, device_type, buckets.watch
                    )
                    return (*buckets.finish(g, row if stats is None else stats + row), classify)
            g, row, classify = _micro_grad(setup, state.params, buffers, micro, factor, device_type)
            if grads is None:
                grads, stats = g, row
            else:
                torch._foreach_add_(list(grads.values()), list(g.values()))
                stats = cast(torch.Tensor, stats) + row  # set with grads, by the first micro-batch
            del g  # free this micro-batch's gradients before the next one's are made
    # micros is never empty: the loop set both.
    return cast("dict[str, torch.Tensor]", grads), cast(torch.Tensor, stats), classify


def _sync(
    setup: _Setup, grads: dict[str, torch.Tensor], stats: torch.Tensor
) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The cross-rank sum of the gradients and the statistics row, in one ``grad_sync`` (not overlapped).

    With fp16, the row first gets this rank's overflow flag (:attr:`StatsLayout.rank_overflows`): summed,
    every rank learns whether any rank overflowed.
    """
    if setup.scaler:
        stats = torch.cat([stats, nonfinite_flag(list(grads.values())).to(stats.device)])
    tree: dict[str, Any] = {"grads": grads, "stats": stats}
    if setup.grad_sync is not None:  # a tree sum (shard_optimizer goes through _sync_shards)
        synced = setup.grad_sync(tree)
        tree = tree if synced is None else synced
    return tree["grads"], tree["stats"]


def _sync_shards(
    setup: _Setup, grads: dict[str, torch.Tensor], stats: torch.Tensor, opt_state: Any
) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, torch.Tensor]]:
    """shard_optimizer: this rank's pieces of the summed gradients (a reduce-scatter), and its buddy's where
    it keeps a copy of that slice (``{}`` otherwise); the statistics row, with fp16 this rank's overflow
    flag, is summed later with the verdict on the pieces (:func:`_read`)."""
    if setup.scaler:
        stats = torch.cat([stats, nonfinite_flag(list(grads.values())).to(stats.device)])
    sync = cast(Optional[ShardSync], setup.grad_sync)
    layout = ShardLayout.of(grads, 1 if sync is None else sync.size)
    mine = reduce_gradients(grads, layout, sync, setup.buffers)
    owner = opt_state.copy_rank if isinstance(opt_state, ShardedState) else None
    copied = {} if sync is None or owner is None else next_gradients(mine, layout, sync, owner)
    return mine, stats, copied


def _read(
    setup: _Setup,
    grads: dict[str, torch.Tensor],
    stats: torch.Tensor,
    scale: float,
    classify: bool,
    copied: dict[str, torch.Tensor],
) -> StepStats:
    """The summed statistics read to the host: the step's one host read.

    With fp16 the summed gradients are unscaled in place first, as GradScaler does after DDP's allreduce,
    and their ``found_inf`` joins the row (:attr:`StatsLayout.sum_overflow`).  With ``shard_optimizer``
    the gradients are this rank's pieces: the row, ``found_inf`` included, is summed over the ranks here.
    """
    if setup.scaler:  # (the buddy's pieces too: its owner unscales them alike; an overflow there counts twice)
        found = unscale_([*grads.values(), *copied.values()], scale)
        stats = torch.cat([stats, found.to(stats.device, torch.float64)])
    if setup.shard and setup.grad_sync is not None:
        stats = cast(ShardSync, setup.grad_sync).sum_(stats)
    return read_stats(stats.tolist(), setup.layout, classify)


def _update(
    setup: _Setup,
    state: TrainState,
    buffers: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    read: StepStats,
    loss_scale: dict[str, torch.Tensor],
    scale: float,
    copied: dict[str, torch.Tensor],
) -> tuple[TrainState, Metrics]:
    """The new state and the metrics: the optimizer's update, or a skipped step (fp16 overflow, a non-finite
    loss with ``on_nonfinite="skip"``); a non-finite loss with ``"raise"`` raises."""
    metrics = read.metrics
    finite = math.isfinite(read.loss_sum)
    new: dict[str, Any] = {"step": state.step + 1}
    if setup.scaler:
        metrics["loss_scale"] = scale
        new["loss_scale"] = next_loss_scale(loss_scale, read.overflow, setup.scaler)
    if not finite and not read.overflow and setup.on_nonfinite == "raise":
        raise NonFiniteLossError(
            f"the loss is {metrics['loss']} at step {int(state.step)}. Lower the learning rate, clip "
            "gradients (optim.clip_by_global_norm), check the data, or skip such steps: pass "
            "on_nonfinite='skip' to raympi.fit (or to make_train_step when you build the step yourself)."
        )
    if setup.on_nonfinite == "skip":
        metrics["nonfinite"] = not finite
    if setup.scaler or setup.on_nonfinite == "skip":
        metrics["skipped"] = int(read.overflow or not finite)
    if read.overflow or not finite:
        # BatchNorm statistics of a forward whose loss was finite are kept, as in a torch loop.
        return state.replace(buffers=buffers if finite else state.buffers, **new), metrics
    if setup.shard:  # never in place: a step abandoned in the all-gather leaves the state as it was
        sync = cast(Optional[ShardSync], setup.grad_sync)
        params, opt_state = apply_sharded(
            setup.optimizer, grads, state.opt_state, state.params, sync, setup.buffers, copied or None
        )
    else:
        params, opt_state = apply_gradients(setup.optimizer, grads, state.opt_state, state.params, donate=setup.donate)
    return state.replace(params=params, buffers=buffers, opt_state=opt_state, **new), metrics
