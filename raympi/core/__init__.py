"""Layer 1, the functional core: ``TrainState``, optimizers and the pure train/eval steps.

Runs in one process with torch alone: nothing under ``raympi.core`` imports Ray or MPI.
"""

from raympi.core import optim, pytree
from raympi.core.precision import LossScaling
from raympi.core.state import TrainState
from raympi.core.step import make_eval_step, make_train_step

__all__ = ["LossScaling", "TrainState", "make_eval_step", "make_train_step", "optim", "pytree"]
