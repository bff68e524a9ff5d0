"""``TrainState``: everything a training run carries from step to step, as one tree.

The functional core's data: parameters, buffers, optimizer state, step count,
seed and the fp16 loss scaler's state, all tensors, in one frozen dataclass registered as a pytree.  The
worker layer broadcasts it, rank 0 hands it to the driver for checkpoints,
and ``train_step`` maps one to the next without touching the old one.

It holds no module and no optimizer: those are static and live in the
closures ``make_train_step`` returns, as in flax's ``TrainState`` minus the
non-leaf fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
from torch import nn

from raympi.core import pytree
from raympi.core.optim import GradientTransformation, from_plain, to_plain
from raympi.core.precision import LossScaling
from raympi.exceptions import ConfigError

__all__ = ["TrainState"]

_FIELDS = ["params", "buffers", "opt_state", "step", "rng_seed", "loss_scale"]
# Fields added after the first release, with the value a dict without them stands for.
_OPTIONAL = {"loss_scale": dict}


@dataclasses.dataclass(frozen=True)
class TrainState:
    """An immutable tree of tensors: one rank's whole training state.

    Attributes:
        params: trainable parameters, a flat dict ``name -> tensor`` as from
            ``model.named_parameters()``.
        buffers: everything else the model reads: its buffers (BatchNorm
            running statistics, updated by the forward pass) and any frozen
            parameters (``requires_grad=False``).
        opt_state: the optimizer state, a tree of the optimizer's state
            NamedTuples, tuples, dicts and tensors (see :mod:`raympi.optim`).
        step: steps taken so far, a 0-d int64 tensor.
        rng_seed: the run's seed, a 0-d int64 tensor; ``train_step`` derives
            each step's dropout seed from it and ``step``.
        loss_scale: the fp16 dynamic loss scaler's state, ``{"scale": 0-d
            float32, "growth_tracker": 0-d int64}`` (see
            :class:`raympi.core.precision.LossScaling`), or ``{}`` when there
            is none yet (fp32 / bf16; an fp16 step starts one).

    Example:
        >>> state = TrainState.create(torch.nn.Linear(2, 1), raympi.optim.sgd(0.1))
        >>> state = state.replace(step=torch.tensor(5))
    """

    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]
    opt_state: Any
    step: torch.Tensor
    rng_seed: torch.Tensor
    loss_scale: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)

    @classmethod
    def create(
        cls,
        model: nn.Module,
        optimizer: GradientTransformation,
        *,
        seed: int = 0,
        loss_scaling: Optional[LossScaling] = None,
    ) -> TrainState:
        """Build the initial state from ``model``'s current tensors.

        The tensors are copied (detached clones), so later changes to the
        module do not leak into the state and the other way round.

        Args:
            model: the ``nn.Module`` to train.
            optimizer: its optimizer, a :class:`raympi.optim.GradientTransformation`.
            seed: the run's seed, stored in ``rng_seed``.
            loss_scaling: for fp16 training, the ``LossScaling`` also given to
                ``make_train_step``: the state then holds the scaler's state
                from step 0 (the same tree structure at every step).  Without
                it the first fp16 step creates it.

        Returns:
            A ``TrainState`` with ``step == 0``.

        Raises:
            ConfigError: the model has no trainable parameter.

        Example:
            >>> state = TrainState.create(model, raympi.optim.adam(1e-3), seed=1)
        """
        params = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        if not params:
            raise ConfigError(
                f"{type(model).__name__} has no trainable parameter (none with "
                "requires_grad=True): there is nothing to train. Check that the model "
                "registers its weights as nn.Parameter and that they are not frozen."
            )
        buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
        buffers.update({n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad})
        return cls(
            params=params,
            buffers=buffers,
            opt_state=optimizer.init(params),
            step=torch.zeros((), dtype=torch.int64),
            rng_seed=torch.tensor(int(seed), dtype=torch.int64),
            loss_scale=loss_scaling.init() if loss_scaling is not None else {},
        )

    def replace(self, **changes: Any) -> TrainState:
        """A copy with the given fields changed; the original is untouched.

        Example:
            >>> state.replace(params=new_params)
        """
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The state as plain dicts, tuples, tensors and strings, for ``torch.save``.

        The optimizer state's NamedTuples become dicts of their fields, each
        naming its type (:func:`raympi.core.optim.to_plain`).  The result loads
        back with ``torch.load(..., weights_only=True)``, raympi imported or
        not; the tensors are shared, not copied.

        Example:
            >>> torch.save(state.to_dict(), "ckpt.pt")
        """
        plain = {f: getattr(self, f) for f in _FIELDS}
        plain["opt_state"] = to_plain(self.opt_state)
        return plain

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainState:
        """Rebuild a state from :meth:`to_dict`'s output.

        No optimizer is needed: the optimizer state's types are named in it
        (:func:`raympi.core.optim.from_plain`).  Dicts saved by older versions
        load too: before a field existed, with its empty value
        (``loss_scale``: ``{}``); before the optimizer state types, with the
        optimizer state's dicts turned into them.

        Raises:
            ValueError: a field is missing or unknown.

        Example:
            >>> state = TrainState.from_dict(torch.load("ckpt.pt", weights_only=True))
        """
        missing, extra = set(_FIELDS) - set(_OPTIONAL) - set(d), set(d) - set(_FIELDS)
        if missing or extra:
            raise ValueError(f"not a TrainState dict: missing {sorted(missing)}, unknown {sorted(extra)}")
        fields = {f: d[f] if f in d else _OPTIONAL[f]() for f in _FIELDS}
        fields["opt_state"] = from_plain(fields["opt_state"])
        return cls(**fields)


pytree.register_dataclass(TrainState, _FIELDS)
