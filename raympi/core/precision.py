"""Mixed precision for ``train_step``: the autocast context and fp16 dynamic loss scaling, as pure functions.

Part of the functional core (torch alone).  The master weights and the
optimizer stay float32; only the forward pass and the loss run under
``torch.autocast``.  With float16 the gradients are computed on a scaled loss
and the scaler's state (the scale and its growth tracker) lives in
``TrainState.loss_scale``, so it is checkpointed, restored and broadcast with
the rest of the state.  The rules are exactly ``torch.amp.GradScaler``'s:
the loss is multiplied by the scale, the (summed) gradients divided by it
with GradScaler's own kernel, a step whose gradients hold an inf or NaN is
skipped and the scale multiplied by ``backoff_factor``, and after
``growth_interval`` finite steps in a row it is multiplied by
``growth_factor``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Literal, NamedTuple

import torch

from raympi.exceptions import ConfigError

__all__ = [
    "Precision",
    "LossScaling",
    "check_precision",
    "cpu_has_native_bf16",
    "autocast",
    "nonfinite_flag",
    "unscale_",
    "next_loss_scale",
]

Precision = Literal["fp32", "bf16", "fp16"]
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cpu_has_native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (the ``avx512_bf16`` or ``amx_bf16`` flag of
    ``/proc/cpuinfo``).  Without it, bf16 matmuls are emulated: measured 6-8x slower than float32.
    True where the flags cannot be read (not Linux): no warning without evidence."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return True
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), None)
    return flags is None or bool({"avx512_bf16", "amx_bf16"} & set(flags))


class LossScaling(NamedTuple):
    """The settings of fp16 dynamic loss scaling; the defaults are ``torch.amp.GradScaler``'s.

    Attributes:
        init_scale: the scale of the first step.
        growth_factor: the scale is multiplied by it after ``growth_interval``
            steps in a row with finite gradients.
        backoff_factor: the scale is multiplied by it after a step whose
            gradients overflowed (that step's update is skipped).
        growth_interval: finite steps in a row before the scale grows.

    Example:
        >>> step = make_train_step(model, F.cross_entropy, opt, precision="fp16",
        ...                        loss_scaling=LossScaling(init_scale=2.0**10))
    """

    init_scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000

    def init(self) -> dict[str, torch.Tensor]:
        """The scaler's state before the first step: ``{"scale", "growth_tracker"}``, 0-d CPU tensors.

        On the CPU on purpose: the step reads the scale as a Python number,
        which must not wait on an accelerator.
        """
        return {
            "scale": torch.tensor(float(self.init_scale), dtype=torch.float32),
            "growth_tracker": torch.zeros((), dtype=torch.int64),
        }


def check_precision(precision: Any, loss_scaling: Any) -> None:
    """Check ``make_train_step``'s ``precision`` and ``loss_scaling`` arguments together.

    Raises:
        ConfigError: an unknown precision, ``loss_scaling`` without fp16, or a bad setting in it.
    """
    if precision not in ("fp32", "bf16", "fp16"):
        raise ConfigError(f"precision must be 'fp32', 'bf16' or 'fp16', got {precision!r}")
    if loss_scaling is None:
        return
    if precision != "fp16":
        raise ConfigError(
            f"loss_scaling is only used with precision='fp16' (got precision={precision!r}): drop it, or train in fp16"
        )
    s = loss_scaling
    if not isinstance(s, LossScaling):
        raise ConfigError(f"loss_scaling must be a raympi.core.precision.LossScaling, got {s!r:.80}")
    if not (s.init_scale > 0 and math.isfinite(s.init_scale)):
        raise ConfigError(f"LossScaling.init_scale must be a positive finite number, got {s.init_scale}")
    if not s.growth_factor > 1.0 or not 0.0 < s.backoff_factor < 1.0:
        raise ConfigError(
            f"LossScaling needs growth_factor > 1 and 0 < backoff_factor < 1, got "
            f"{s.growth_factor} and {s.backoff_factor}"
        )
    if not (isinstance(s.growth_interval, int) and s.growth_interval > 0):
        raise ConfigError(f"LossScaling.growth_interval must be a positive int, got {s.growth_interval!r}")


def autocast(precision: Precision, device_type: str) -> contextlib.AbstractContextManager[Any]:
    """The context the forward pass and the loss run in.

    Args:
        precision: ``"fp32"`` (no autocast), ``"bf16"`` or ``"fp16"``.
        device_type: the parameters' device type (``"cpu"``, ``"cuda"``).

    Returns:
        ``torch.autocast`` to the precision's dtype, or a null context.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device_type, dtype=_DTYPES[precision])


def nonfinite_flag(grads: list[torch.Tensor]) -> torch.Tensor:
    """Whether some gradient holds an inf or NaN, without a host read.

    Args:
        grads: a non-empty list of tensors.

    Returns:
        1.0 or 0.0, a float64 tensor of shape (1,) on the first tensor's device.
    """
    # The max of the per-tensor max-norms: inf or NaN exactly when some element is, and no sum to overflow.
    worst = torch.stack([n.to(grads[0].device) for n in torch._foreach_norm(grads, float("inf"))]).max()
    return (~torch.isfinite(worst)).to(torch.float64).reshape(1)


def unscale_(grads: list[torch.Tensor], scale: float) -> torch.Tensor:
    """Divide ``grads`` by ``scale`` in place, as ``GradScaler.unscale_`` does.

    Args:
        grads: the (summed) gradients, a non-empty list; overwritten.
        scale: the loss scale the step used.

    Returns:
        ``found_inf``: a float32 tensor of shape (1,) on the first gradient's
        device, non-zero when some gradient holds an inf or NaN.  No host read.
    """
    # GradScaler's inverse: computed in float64, rounded to float32.
    inv = torch.tensor([scale], dtype=torch.float64).reciprocal().float()
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    found = []
    for device, group in by_device.items():
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, flag, inv.to(device))
        found.append(flag.to(grads[0].device))
    return torch.stack(found).sum(0)


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def next_loss_scale(loss_scale: dict[str, torch.Tensor], found_inf: bool, cfg: LossScaling) -> dict[str, torch.Tensor]:
    """The scaler's next state, by ``torch._amp_update_scale_``'s rules (float64 arithmetic, float32 result).

    Args:
        loss_scale: the scaler's state (``TrainState.loss_scale``), not changed.
        found_inf: whether this step's gradients overflowed on some rank.
        cfg: the scaler's settings.

    Returns:
        The new ``{"scale", "growth_tracker"}``, on the devices of the old.
    """
    scale, tracker = float(loss_scale["scale"]), int(loss_scale["growth_tracker"])
    if found_inf:
        scale, tracker = _f32(scale * cfg.backoff_factor), 0
    else:
        tracker += 1
        if tracker == cfg.growth_interval:
            grown = _f32(scale * cfg.growth_factor)
            if math.isfinite(grown):  # never grow past float32's range
                scale = grown
            tracker = 0
    return {
        "scale": torch.tensor(scale, dtype=torch.float32, device=loss_scale["scale"].device),
        "growth_tracker": torch.tensor(tracker, dtype=torch.int64, device=loss_scale["growth_tracker"].device),
    }
