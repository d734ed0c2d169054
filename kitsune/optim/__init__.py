"""torch.optim-style optimizers kitsune adds, with eager reference math."""

from kitsune.optim.lion import Lion

__all__ = ["Lion"]
