"""Newton-Schulz coefficient schedules (no Triton needed: the eager Muon path reads them too)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

Coefficients = tuple[float, float, float]

MUON_COEFFICIENTS: Coefficients = (3.4445, -4.7750, 2.0315)
"""Keller Jordan's quintic (torch.optim.Muon's default): maximal slope at zero, singular values land in ~[0.7, 1.2]."""

_POLAR_EXPRESS_PUBLISHED = (
    (8.28721201814563, -23.595886519098837, 17.300387312530933),
    (4.107059111542203, -2.9478499167379106, 0.5448431082926601),
    (3.9486908534822946, -2.908902115962949, 0.5518191394370137),
    (3.3184196573706015, -2.488488024314874, 0.51004894012372),
    (2.300652019954817, -1.6689039845747493, 0.4188073119525673),
    (1.891301407787398, -1.2679958271945868, 0.37680408948524835),
    (1.8750014808534479, -1.2500016453999487, 0.3750001645474248),
    (1.875, -1.25, 0.375),
)
_PE_SAFETY = 1.01
_PE_SAFE = [(a / _PE_SAFETY, b / _PE_SAFETY**3, c / _PE_SAFETY**5) for a, b, c in _POLAR_EXPRESS_PUBLISHED[:-1]]
_PE_SAFE.append(_POLAR_EXPRESS_PUBLISHED[-1])
POLAR_EXPRESS_COEFFICIENTS: tuple[Coefficients, ...] = (
    # the paper normalises by 1.01 ||X||_F; p(x / s) = (a/s) x + (b/s^3) x^3 + (c/s^5) x^5 moves that into step 1
    (_PE_SAFE[0][0] / _PE_SAFETY, _PE_SAFE[0][1] / _PE_SAFETY**3, _PE_SAFE[0][2] / _PE_SAFETY**5),
    *_PE_SAFE[1:],
)
"""Polar Express (Amsel, Persson, Musco, Gower 2025, arXiv:2505.16932, Algorithm 1), degree 5: the eight published
per-iteration triples with the paper's 1.01 safety factor (``a/1.01, b/1.01^3, c/1.01^5``, all but the last), and
the paper's ``X / (1.01 ||X||_F)`` normalisation folded into the first triple, so it runs with the plain
``||X||_F`` normalisation every schedule here uses. Iterations past the eighth repeat the last triple, as the
paper's code does: ``newton_schulz(X, steps=5, coefficients=POLAR_EXPRESS_COEFFICIENTS)``."""


def schedule(coefficients: Coefficients | Sequence[Coefficients], steps: int) -> list[Coefficients]:
    """The ``(a, b, c)`` of each of ``steps`` iterations: one triple for all, or a per-iteration sequence whose
    last triple repeats past its end (as Polar Express's code does)."""
    if isinstance(coefficients, Sequence) and len(coefficients) == 3:
        if all(isinstance(v, numbers.Real) for v in coefficients):
            coefficients = [coefficients]  # type: ignore[list-item]
    try:
        triples = [tuple(float(v) for v in t) for t in coefficients]  # type: ignore[union-attr]
    except TypeError:
        triples = []
    if not triples or any(len(t) != 3 for t in triples):
        raise ValueError(f"coefficients must be an (a, b, c) triple or a sequence of them, got {coefficients!r}")
    return [triples[min(i, len(triples) - 1)] for i in range(steps)]  # type: ignore[misc]
