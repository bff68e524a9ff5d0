"""Layer 2: how tensors travel on MPI, as constants shared by the communicator and its torch side.

Torch-free, so that a "light" member (a process without torch) can import it.
"""

from __future__ import annotations

__all__ = ["COMPRESSIONS", "INPLACE_MIN_BYTES", "WIDENED"]

#: Below this a tensor is packed with others (one call for many small ones); above, copying it into a
#: buffer costs more than the extra MPI call (measured: per-parameter calls beat one copied flat buffer
#: for a 5.8M-parameter MLP).  Also the size from which a wait polls flat out for a while.
INPLACE_MIN_BYTES = 256 * 2**10
#: Optional compression of float32 tensors to 16-bit floats on the wire (``Communicator(compression=...)``).
COMPRESSIONS = ("bf16", "fp16")
#: The torch dtypes MPI has no type for; they are summed in float32 (exact accumulation, one rounding back), at
#: twice the bytes.
WIDENED = ("bfloat16", "float16")
