"""kitsune: a fast optimizer phase for PyTorch training, with one line of code.

optimizer = KitsuneOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-4), enable_fusion=True)
"""

from kitsune.clip import clip_grad_norm_
from kitsune.config import (
    AMPConfig,
    FusionConfig,
    GradConfig,
    GraphConfig,
    KitsuneConfig,
    MemoryConfig,
    ProfilerConfig,
    ShardConfig,
    StreamConfig,
)
from kitsune.fusion.state_format import convert_state_dict
from kitsune.optimizer import KitsuneOptimizer

__version__ = "0.1.0"

__all__ = [
    "AMPConfig",
    "FusionConfig",
    "GradConfig",
    "GraphConfig",
    "KitsuneConfig",
    "KitsuneOptimizer",
    "MemoryConfig",
    "ProfilerConfig",
    "ShardConfig",
    "StreamConfig",
    "__version__",
    "clip_grad_norm_",
    "convert_state_dict",
]
