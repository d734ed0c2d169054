"""``--device`` of the ``kitsune`` commands (``demo``, ``bench``): one parser, so one message per mistake."""

from __future__ import annotations

import argparse
import re

import torch

DEVICES = "auto, cpu, cuda or cuda:N"
"""What ``--device`` takes, as its error messages list it."""

# torch's own spelling of an index: no sign, no leading zero (torch.device refuses "cuda:01" and "cuda:-1")
_CUDA_N = re.compile(r"cuda:(0|[1-9][0-9]*)")


def parse_device(text: str) -> torch.device:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N`` -> the device; ``auto``: ``cuda`` where torch sees a GPU, else ``cpu``.

    ``cuda`` keeps no index (torch's current GPU). Raises a ValueError, one message per case: CUDA where torch sees
    no GPU, ``cuda:N`` past the GPUs torch sees, and any other text (``cpu:1``, ``mps``, ``gpu``, ``""``, ``CUDA``).
    """
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if text == "cpu":
        return torch.device("cpu")
    match = _CUDA_N.fullmatch(text)
    if text != "cuda" and match is None:
        raise ValueError(f"choose {DEVICES} (N: a GPU index), got {text!r}")
    if not torch.cuda.is_available():
        raise ValueError(
            f"{text} asked for, but torch {torch.__version__} sees no CUDA GPU: use --device cpu, or --device auto "
            "to take a GPU only when there is one"
        )
    if match is None:
        return torch.device("cuda")
    index, count = int(match[1]), torch.cuda.device_count()
    if index >= count:
        gpus = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        raise ValueError(f"{text} asked for, but torch sees {count} CUDA GPU{'s' * (count != 1)}: use {gpus} or cuda")
    return torch.device("cuda", index)


def device_arg(text: str) -> str:
    """An argparse ``type`` for ``--device``: `parse_device`'s device as text (``auto`` -> ``cpu`` or ``cuda``), its
    ValueError as argparse's one error line, before any work."""
    try:
        return str(parse_device(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
