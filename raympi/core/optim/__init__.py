"""Optimizers as pure ``(init, update)`` pairs, in the manner of optax.

This is the update half of the functional core: ``train_step`` computes a
gradient tree and hands it to the optimizer, which returns new parameters
and a new optimizer state.  Nothing here touches Ray or MPI, and nothing
mutates its inputs unless told it may (``donate``): functions return new
tensors, so a ``TrainState`` can be reused, compared or checkpointed at any
point.

* An optimizer is a :class:`GradientTransformation`: ``init(params)`` returns
  the optimizer state; ``update(grads, state, params)`` returns
  ``(updates, new_state)``; updates are *added* to the parameters with
  :func:`apply_updates`, so a descent step carries the minus sign.
* :func:`apply_gradients` does update and apply in one go.  Where an
  optimizer has a ``fused_apply`` (``sgd``, ``adam``, ``adamw``,
  ``from_torch``, and a ``chain`` ending in one) it computes the new
  parameters straight away: two fewer passes over memory, and the very
  arithmetic of its ``torch.optim`` twin.  ``train_step`` uses it.
* ``donate=True`` (as JAX's buffer donation) lets ``apply_gradients`` write
  the new parameters and optimizer state into the old ones' memory, for a
  caller that drops the old state anyway: no second copy of the parameters
  and optimizer state, and no fresh allocations (which on the CPU cost page
  faults every step).  The default never mutates anything.
* Each transformation keeps its own small NamedTuple state, as optax's
  (``adam``: :class:`ScaleByAdamState` ``(count, mu, nu)``; a :func:`chain`:
  the tuple of its parts'; see :mod:`~raympi.core.optim.states`).  States are
  trees of tensors: they flatten through :mod:`raympi.core.pytree`, and
  ``TrainState.to_dict`` saves them as plain dicts that
  ``torch.load(weights_only=True)`` reads (:func:`to_plain` /
  :func:`from_plain`, which also reads the dicts of older checkpoints).  Step
  counters are 0-d int64 tensors kept on the CPU: reading them for a schedule
  never waits on an accelerator.
* The arithmetic runs on whole lists of tensors with torch's multi-tensor
  ``torch._foreach_*`` kernels, as ``torch.optim`` does with ``foreach=True``.
* A learning rate is a float or a *schedule*: a callable ``count -> lr``
  (:func:`constant`, :func:`cosine_decay`, :func:`linear_warmup`); step ``k``
  (from 0) uses ``lr(k)``.
* :func:`from_torch` wraps any ``torch.optim.Optimizer`` class for the cases
  the native optimizers do not cover.
* Wrappers, as optax's: :func:`masked` and :func:`multi_transform` (with
  :func:`set_to_zero`) run transformations on some parameters only;
  :func:`inject_hyperparams` keeps the current learning rate in the state
  (:func:`current_hyperparams` reads it for logging); :func:`ema` keeps a
  moving average of the parameters (:func:`ema_params`);
  :func:`apply_if_finite` skips steps with non-finite gradients.

Layout, as optax's ``_src``: :mod:`~raympi.core.optim.base` (the interface,
:func:`apply_gradients`, :func:`chain`), :mod:`~raympi.core.optim.states`
(the state types, :func:`find_states`, the plain form of checkpoints),
:mod:`~raympi.core.optim.transform`
(building blocks: :func:`clip_by_global_norm`, :func:`scale_by_adam`,
:func:`add_decayed_weights`, :func:`scale_by_learning_rate`, from which
``adam`` and ``adamw`` can be rebuilt as chains, and :func:`ema`),
:mod:`~raympi.core.optim.alias` (the optimizers),
:mod:`~raympi.core.optim.schedule` (learning-rate schedules),
:mod:`~raympi.core.optim.partition` (per-parameter transformations) and
:mod:`~raympi.core.optim.wrappers` (:func:`inject_hyperparams`, :func:`apply_if_finite`).

No decay on biases and norms, AdamW as ``torch.optim.AdamW`` with two
parameter groups (or ``adamw(lr, mask=decay)``, fused)::

    decay = lambda params: {n: p.ndim >= 2 for n, p in params.items()}
    opt = optim.chain(optim.scale_by_adam(), optim.masked(optim.add_decayed_weights(0.01), decay),
                      optim.scale_by_learning_rate(1e-3))

Example:
    >>> import torch
    >>> from raympi.core import optim
    >>> opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-3))
    >>> params = {"w": torch.ones(3)}
    >>> state = opt.init(params)
    >>> params, state = optim.apply_gradients(opt, {"w": torch.ones(3)}, state, params)
"""

from raympi.core.optim.alias import adam, adamw, from_torch, sgd
from raympi.core.optim.base import (
    GradientTransformation,
    ScalarOrSchedule,
    Schedule,
    ShardView,
    apply_gradients,
    apply_updates,
    chain,
    cross_rank_sum,
    shard_view,
    sharded,
)
from raympi.core.optim.partition import masked, multi_transform, set_to_zero
from raympi.core.optim.schedule import constant, cosine_decay, linear_warmup
from raympi.core.optim import states
from raympi.core.optim.states import *  # noqa: F403  (its __all__: the states and their plain-dict form)
from raympi.core.optim.transform import (
    add_decayed_weights,
    clip_by_global_norm,
    ema,
    ema_params,
    scale_by_adam,
    scale_by_learning_rate,
)
from raympi.core.optim.wrappers import apply_if_finite, current_hyperparams, inject_hyperparams

__all__ = [
    "GradientTransformation",
    "Schedule",
    "ScalarOrSchedule",
    "apply_updates",
    "apply_gradients",
    "chain",
    "sgd",
    "adam",
    "adamw",
    "clip_by_global_norm",
    "from_torch",
    "constant",
    "cosine_decay",
    "linear_warmup",
    "scale_by_adam",
    "add_decayed_weights",
    "scale_by_learning_rate",
    "masked",
    "multi_transform",
    "set_to_zero",
    "inject_hyperparams",
    "current_hyperparams",
    "ema",
    "ema_params",
    "apply_if_finite",
    "ShardView",
    "sharded",
    "shard_view",
    "cross_rank_sum",
]
__all__ += states.__all__
