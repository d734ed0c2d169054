"""How a CUDA graph is captured and replayed: torch.cuda.CUDAGraph (tests stand in a recording backend)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class CudaGraphBackend:
    """torch.cuda.CUDAGraph: capture on torch's capture stream, eager warm-up on a side stream."""

    def supports(self, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "needs CUDA params"
        if not torch.cuda.is_available():
            return "CUDA is not available"
        return None

    def eager(self, fn: Callable[[], None], device: torch.device) -> None:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            fn()
        current.wait_stream(side)

    def capture(self, fn: Callable[[], None], device: torch.device) -> Any:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(device), torch.cuda.graph(graph):
            fn()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()
