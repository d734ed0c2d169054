"""Triton kernels and their launch functions (no torch.optim imports here).

``spec`` and ``multi_tensor`` import without Triton; ``update`` needs it.
"""

from kitsune.kernels.multi_tensor import DEAD, DEFAULT_BLOCK, TensorTables, block_map
from kitsune.kernels.spec import NUM_FIELDS, Algo, UpdateSpec

try:  # Triton is optional: without it the planner explains why nothing is fused
    from kitsune.kernels.update import SUPPORTED_DTYPES, multi_tensor_update
except ImportError:  # pragma: no cover - exercised by the planner tests through a patched import
    SUPPORTED_DTYPES = ()
    multi_tensor_update = None  # type: ignore[assignment]

__all__ = [
    "DEAD",
    "DEFAULT_BLOCK",
    "NUM_FIELDS",
    "SUPPORTED_DTYPES",
    "Algo",
    "TensorTables",
    "UpdateSpec",
    "block_map",
    "multi_tensor_update",
]
