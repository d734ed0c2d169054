"""What a launch of the update kernel computes: the algorithm, its compile-time switches and the layout of the
hyperparameter buffer. Importable without Triton, so the planner can explain why it cannot fuse."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Algo(IntEnum):
    ADAM = 0
    SGD = 1
    ADAGRAD = 2
    RMSPROP = 3
    LION = 4


# Columns of the float64 hyperparameter buffer (one row per param group). Algorithms share columns:
#   B1: Adam/Lion beta1, SGD/RMSprop momentum.  B2: Adam/Lion beta2, RMSprop alpha.
#   EXTRA: SGD dampening, Adagrad lr_decay.
LR, B1, B2, EPS, WD, EXTRA = range(6)
NUM_FIELDS = 8  # padded to 64-byte rows


@dataclass(frozen=True)
class UpdateSpec:
    """The compile-time switches of one launch."""

    algo: Algo
    maximize: bool = False
    decoupled_wd: bool = False
    """Adam: AdamW's ``p *= 1 - lr * wd`` instead of L2 (``g += wd * p``). Lion always decouples."""
    amsgrad: bool = False
    momentum: bool = False
    """SGD ``momentum != 0`` / RMSprop ``momentum > 0``: a momentum_buffer exists."""
    nesterov: bool = False
    centered: bool = False

    @property
    def has_step(self) -> bool:
        """Whether the launch reads and advances a per-tensor step count (SGD: only to spot the first step)."""
        return self.algo in (Algo.ADAM, Algo.ADAGRAD, Algo.RMSPROP) or (self.algo == Algo.SGD and self.momentum)

    @property
    def state_slots(self) -> int:
        """How many state roles (``state1``..``state3``) the launch reads."""
        if self.algo == Algo.ADAM:
            return 3 if self.amsgrad else 2
        if self.algo == Algo.RMSPROP:
            return 3 if self.centered else (2 if self.momentum else 1)
        if self.algo == Algo.SGD:
            return 1 if self.momentum else 0
        return 1

    def describe(self) -> str:
        """The switches that are on, e.g. ``"decoupled_wd, amsgrad"`` (``"-"`` for none)."""
        on = [
            n for n in ("maximize", "decoupled_wd", "amsgrad", "momentum", "nesterov", "centered") if getattr(self, n)
        ]
        return ", ".join(on) or "-"
