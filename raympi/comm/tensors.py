"""Layer 2, the torch side of the collectives: packing tensor trees into MPI buffers and back.

:class:`~raympi.comm.Communicator` imports this module only on its tensor paths (``allreduce_`` of a
tensor tree, ``broadcast`` from a process that holds tensors, ``compression``), so formation,
barriers and buffer reductions work in a "light" member: a process without torch.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, Callable

import torch

from raympi.comm.wire import INPLACE_MIN_BYTES, WIDENED
from raympi.core import pytree

__all__ = [
    "REDUCE_AS",
    "REDUCIBLE",
    "WIRE",
    "allreduce_tree_",
    "as_16bit_ints",
    "empty_payload",
    "pack_tree",
    "sum_16bit",
    "unpack_tree",
]

#: The dtype each 16-bit float type is summed in, float32, since MPI has none of its own (see
#: :data:`raympi.comm.wire.WIDENED`).
REDUCE_AS = {getattr(torch, name): torch.float32 for name in WIDENED}
#: The 16-bit dtype of each ``compression`` setting; float32 gradients travel as it and are summed by a
#: user-defined op.
WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The dtypes MPI sums as they are.
REDUCIBLE = {torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.int8, torch.uint8}


def allreduce_tree_(reduce_flat: Callable[..., None], tensors: Any, compression: str | None) -> Any:
    """Sum every tensor of ``tensors`` in place, each flat CPU buffer through ``reduce_flat``.

    See :meth:`raympi.comm.Communicator.allreduce_`, which calls it with its own ``_reduce_flat``.
    """
    packed: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in pytree.tensor_leaves(tensors):
        wire = REDUCE_AS.get(t.dtype, t.dtype)
        if wire not in REDUCIBLE:
            raise TypeError(f"allreduce cannot sum tensors of dtype {t.dtype}")
        if compression and t.dtype == torch.float32:
            wire = WIRE[compression]
        if (
            t.dtype == wire
            and t.is_contiguous()
            and not t.is_cuda
            and t.numel() * t.element_size() >= INPLACE_MIN_BYTES
        ):
            reduce_flat(t.detach().view(-1))
        else:
            packed.setdefault(wire, []).append(t)
    for wire, group in packed.items():
        flat = torch.empty(sum(t.numel() for t in group), dtype=wire, device=group[0].device)
        offset = 0
        for t in group:  # one copy in, casting to the wire dtype on the way
            flat[offset : offset + t.numel()].view(t.shape).copy_(t.detach())
            offset += t.numel()
        host = _to_host(flat)
        if host is flat:
            reduce_flat(flat)
        else:  # each bucket back to the device as soon as its sum is in, while MPI sums the next
            reduce_flat(host, lambda start, stop: flat[start:stop].copy_(host[start:stop], non_blocking=True))
        offset = 0
        for t in group:
            t.detach().copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
    return tensors


def as_16bit_ints(flat: torch.Tensor) -> Any:
    """A 16-bit float tensor's memory as a numpy int16 array (how it travels, under a user-defined op); else None."""
    return flat.view(torch.int16).numpy() if flat.dtype in (torch.bfloat16, torch.float16) else None


def pack_tree(tree: Any) -> tuple[tuple[Any, list[Any], int], torch.Tensor]:
    """``((spec, layout, nbytes), payload)``: the structure to pickle and the tensor bytes as one uint8 tensor."""
    leaves, spec = pytree.flatten(tree)
    layout = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("obj", x) for x in leaves]
    tensors = [x.detach().contiguous().cpu() for x in leaves if isinstance(x, torch.Tensor)]
    payload = (
        torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]) if tensors else torch.empty(0, dtype=torch.uint8)
    )
    return (spec, layout, payload.numel()), payload


def empty_payload(nbytes: int) -> torch.Tensor:
    """A receive buffer for :func:`pack_tree`'s payload."""
    return torch.empty(nbytes, dtype=torch.uint8)


def unpack_tree(spec: Any, layout: list[Any], payload: torch.Tensor) -> Any:
    """The tree :func:`pack_tree` was given, rebuilt as CPU tensors from the received ``payload``."""
    leaves, offset = [], 0
    for kind, value in layout:
        if kind == "obj":
            leaves.append(value)
            continue
        shape, dtype = kind, value
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        leaves.append(payload[offset : offset + nbytes].clone().view(dtype).view(shape))  # clone: aligned storage
        offset += nbytes
    return pytree.unflatten(leaves, spec)


def sum_16bit(name: str) -> Any:
    """An MPI reduction function summing buffers of 16-bit floats (``name``: a key of :data:`WIRE`; MPI has no such
    type)."""
    dtype = WIRE[name]

    def op(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
        with warnings.catch_warnings():  # MPI may hand a read-only input buffer; it is only read
            warnings.simplefilter("ignore", UserWarning)
            torch.frombuffer(inoutbuf, dtype=dtype).add_(torch.frombuffer(inbuf, dtype=dtype))

    return op


def _to_host(flat: torch.Tensor) -> torch.Tensor:
    # The PyPI MPICH is not CUDA-aware: GPU buffers are staged through pinned host memory.
    if flat.is_cuda:
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat)
        return host
    return flat
