"""torch.optim-style optimizers kitsune adds, with eager reference math."""

from kitsune.optim.lamb import LAMB
from kitsune.optim.lars import LARS
from kitsune.optim.lion import Lion
from kitsune.optim.muon import Muon

__all__ = ["LAMB", "LARS", "Lion", "Muon"]
