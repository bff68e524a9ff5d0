"""``make_train_step`` / ``make_eval_step``: training as pure functions of a ``TrainState``.

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

The global-batch rule: the loss of a step is the mean over the samples of the
*global* batch.  Each rank scales its local mean loss by
``local_n / global_batch_size`` and the ranks' gradients are summed, so any
split of one global batch over any number of ranks gives the same update up
to floating-point summation order.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Optional

import torch
from torch import nn
from torch.func import functional_call

from raympi.core.batch import Batch, _split_batch, correct_predictions
from raympi.core.optim import GradientTransformation, apply_gradients
from raympi.core.rng import _seed_generators, _step_seed
from raympi.core.state import TrainState
from raympi.exceptions import ConfigError, NonFiniteLossError, TrainingError

__all__ = ["make_train_step", "make_eval_step"]

Metrics = dict[str, Any]
LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
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
) -> Callable[..., tuple[TrainState, Metrics]]:
    """Build ``train_step(state, batch, global_batch_size=None) -> (new_state, metrics)``.

    The model is only a template: its own tensors are never read or written
    (``functional_call`` substitutes the state's).  It runs in train mode.

    ``batch`` is ``(inputs, targets)`` or ``{"inputs": ..., "targets": ...}``;
    ``inputs`` is a tensor (``model(inputs)``), a tuple (``model(*inputs)``)
    or a dict (``model(**inputs)``); ``targets`` is a tensor, first dimension
    the batch.  ``global_batch_size`` is the sample count of the whole step
    over all ranks; it defaults to this batch's size (one process).

    ``grad_sync``, when given, is called once per step with the tree
    ``{"grads": {name: tensor}, "stats": float64 tensor [loss * n, correct,
    n, n_targets]}`` and must return the leaf-wise SUM over the ranks (a new
    tree, or ``None`` after summing in place).  Riding the statistics on the
    gradient allreduce makes the metrics global at no extra collective.

    Metrics are Python numbers, already global: ``"loss"`` (mean over the
    global batch), ``"samples"`` and, when the targets are integer class ids
    for outputs shaped ``(N, C, ...)``, ``"accuracy"``.  With
    ``on_nonfinite="skip"`` there is also ``"nonfinite"`` (bool).

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
            never touch an old state again.  Saves a second copy of the
            parameters and optimizer state and, on the CPU, the page faults of
            fresh allocations.  The input state is then garbage: do not keep
            it (for a checkpoint, say: copy first) and do not donate tensors
            you do not own, such as read-only buffers from Ray's object store.
            Off by default: ``train_step`` is then pure.

    Returns:
        ``train_step``, a pure function of ``(state, batch, global_batch_size)``
        (unless ``donate``).

    Raises:
        ConfigError: the model has no trainable parameter, or a bad ``on_nonfinite``.

    Example:
        >>> step = make_train_step(model, F.cross_entropy, raympi.optim.sgd(0.1))
        >>> state = TrainState.create(model, raympi.optim.sgd(0.1))
        >>> state, metrics = step(state, (x, y))
        >>> metrics["loss"], metrics["accuracy"], metrics["samples"]
    """
    if on_nonfinite not in ("raise", "skip"):
        raise ConfigError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
    trainable = set(_trainable(model))
    # Only real buffers can be written by the forward pass (frozen params cannot).
    mutable = {n for n, _ in model.named_buffers()}

    def loss_of(params, buffers, args, kwargs, targets, scale):
        outputs = functional_call(model, (params, buffers), args, kwargs)
        loss = loss_fn(outputs, targets)
        _check_loss(loss)
        aux = {"loss": loss.detach()}
        correct = correct_predictions(outputs, targets)
        if correct is not None:
            aux["correct"] = correct
        # Differentiate the share of the global mean; report the local mean.
        return loss * scale, aux

    def grad_fn(params, buffers, args, kwargs, targets, scale):
        """``(gradients, (loss, aux))`` of ``loss_of`` with respect to ``params``; ``params`` is not touched."""
        leaves = {k: v.detach().requires_grad_(True) for k, v in params.items()}
        with torch.enable_grad():
            loss, aux = loss_of(leaves, buffers, args, kwargs, targets, scale)
            if loss.requires_grad:
                grads = torch.autograd.grad(loss, list(leaves.values()), materialize_grads=True)
            else:  # a loss that does not depend on the parameters
                grads = tuple(torch.zeros_like(v) for v in leaves.values())
        return dict(zip(leaves, grads)), (loss.detach(), aux)

    def train_step(
        state: TrainState, batch: Batch, global_batch_size: Optional[int] = None
    ) -> tuple[TrainState, Metrics]:
        args, kwargs, targets, n = _split_batch(batch)
        if set(state.params) != trainable:
            raise TrainingError(
                "state.params does not match the model's trainable parameters: missing "
                f"{sorted(trainable - set(state.params))}, unexpected "
                f"{sorted(set(state.params) - trainable)}. Build it with TrainState.create(model, ...)."
            )
        global_n = n if global_batch_size is None else int(global_batch_size)
        step, seed = int(state.step), int(state.rng_seed)
        # The forward writes running statistics into the buffers it is given:
        # give it copies so the input state stays as it was.
        buffers = {k: (v.clone() if k in mutable else v) for k, v in state.buffers.items()}
        cuda = sorted({t.device.index or 0 for t in state.params.values() if t.device.type == "cuda"})
        was_training = model.training
        model.train()
        try:
            with torch.random.fork_rng(devices=cuda):
                _seed_generators(_step_seed(seed, step, rank), cuda)
                grads, (_, aux) = grad_fn(state.params, buffers, args, kwargs, targets, n / global_n)
        finally:
            model.train(was_training)

        loss, correct = aux["loss"], aux.get("correct")
        classify = correct is not None
        zero = torch.zeros((), dtype=torch.float64, device=loss.device)
        stats = torch.stack([
            loss.double() * n,
            correct.to(loss.device, torch.float64) if classify else zero,
            zero + n,
            zero + targets.numel(),
        ])
        tree = {"grads": grads, "stats": stats}
        if grad_sync is not None:
            synced = grad_sync(tree)
            tree = tree if synced is None else synced
        grads = tree["grads"]
        loss_sum, n_correct, total, n_targets = tree["stats"].tolist()  # the step's one host read

        if global_batch_size is not None and total != global_n:
            raise TrainingError(
                f"the ranks' batches hold {int(total)} samples in all but global_batch_size is "
                f"{global_n}: pass the size of the whole step's batch over all ranks"
            )
        metrics: Metrics = {"loss": loss_sum / total, "samples": int(total)}
        if classify:
            metrics["accuracy"] = n_correct / n_targets
        if not math.isfinite(loss_sum):
            if on_nonfinite == "raise":
                raise NonFiniteLossError(
                    f"the loss is {loss_sum / total} at step {step}. Lower the learning rate, clip "
                    "gradients (optim.clip_by_global_norm), check the data, or pass "
                    "on_nonfinite='skip' to make_train_step to skip such steps."
                )
            metrics["nonfinite"] = True
            return state.replace(step=state.step + 1), metrics
        if on_nonfinite == "skip":
            metrics["nonfinite"] = False

        params, opt_state = apply_gradients(optimizer, grads, state.opt_state, state.params, donate=donate)
        new_state = state.replace(
            params=params,
            buffers=buffers,
            opt_state=opt_state,
            step=state.step + 1,
        )
        return new_state, metrics

    return train_step


def make_eval_step(
    model: nn.Module, metric_fns: dict[str, Callable[[Any, torch.Tensor], torch.Tensor]]
) -> Callable[[TrainState, Batch], Metrics]:
    """Build ``eval_step(state, batch) -> metrics``, run in eval mode without gradients.

    Each ``metric_fns[name](outputs, targets)`` returns the MEAN over the
    batch (a scalar); ``eval_step`` returns it multiplied back to a SUM, plus
    ``"samples"``, all Python numbers.  Sums add up across batches and ranks,
    so the global mean is ``sum(m[name]) / sum(m["samples"])``.

    Args:
        model: the ``nn.Module`` whose forward is used (in eval mode).
        metric_fns: name -> ``fn(outputs, targets) -> scalar mean``.  The name
            ``"samples"`` is reserved.

    Returns:
        ``eval_step``, a pure function of ``(state, batch)``; the batch format
        is :func:`make_train_step`'s.

    Example:
        >>> ev = make_eval_step(model, {"loss": F.cross_entropy,
        ...     "accuracy": lambda o, t: (o.argmax(1) == t).float().mean()})
        >>> sums = [ev(state, b) for b in batches]
        >>> acc = sum(s["accuracy"] for s in sums) / sum(s["samples"] for s in sums)
    """
    if "samples" in metric_fns:
        raise ConfigError("metric_fns may not use the name 'samples': eval_step reports the count under it")
    names = list(metric_fns)

    def eval_step(state: TrainState, batch: Batch) -> Metrics:
        args, kwargs, targets, n = _split_batch(batch)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                outputs = functional_call(model, (state.params, state.buffers), args, kwargs)
                values = []
                for name in names:
                    v = metric_fns[name](outputs, targets)
                    if not isinstance(v, torch.Tensor) or v.ndim != 0:
                        raise TrainingError(
                            f"metric {name!r} must return a scalar tensor (the mean over the "
                            f"batch), got {v!r:.80}"
                        )
                    values.append(v.detach().to(torch.float64))
        finally:
            model.train(was_training)
        means = torch.stack([v.to(values[0].device) for v in values]).tolist() if values else []
        out: Metrics = {name: m * n for name, m in zip(names, means)}
        out["samples"] = n
        return out

    return eval_step
