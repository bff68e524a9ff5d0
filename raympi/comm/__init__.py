"""Layer 2, the communicator: Ray actors joined into one MPI communicator, and collectives on tensors.

Knows nothing of training.  The MPI library is loaded (and checked) only when a group is formed,
so importing this package needs neither MPI nor a running Ray.  :mod:`~raympi.comm.formation`
joins the actors (:class:`Member`, :func:`form`) and derives new groups from the standby communicator
they keep (:func:`derive`); :mod:`~raympi.comm.communicator` runs the collectives
(:class:`Communicator`); :mod:`~raympi.comm.library` loads and checks MPI.
"""

from raympi.comm.communicator import DEFAULT_BUCKET_BYTES, Communicator
from raympi.comm.formation import Member, derive, form

__all__ = ["Communicator", "DEFAULT_BUCKET_BYTES", "Member", "derive", "form"]
