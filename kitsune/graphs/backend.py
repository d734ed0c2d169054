"""How a CUDA graph is captured and replayed: torch.cuda.CUDAGraph (tests stand in a recording backend)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
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

    def collectives(self, groups: Sequence[Any]) -> str | None:
        """None when a graph can capture collectives over ``groups`` (NCCL 2.9.6 or later, whose collectives torch
        lets a CUDA graph capture); else why not."""
        import torch.distributed as dist

        for group in groups:
            backend = dist.get_backend(group)
            if backend != "nccl":
                return f"its all-reduce runs over {backend}, which a CUDA graph cannot capture (NCCL can)"
        if groups and torch.cuda.nccl.version() < (2, 9, 6):
            version = ".".join(map(str, torch.cuda.nccl.version()))
            return f"NCCL {version} cannot be captured in a CUDA graph (2.9.6 or later can)"
        return None

    def eager(self, fn: Callable[[], None], device: torch.device) -> None:
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                fn()
        finally:  # a launch that raised midway: what the side stream already runs is done before the caller goes on
            current.wait_stream(side)

    def capture(self, fn: Callable[[], None], device: torch.device, collectives: bool = False) -> Any:
        """Capture ``fn``'s device work. With ``collectives`` (NCCL calls among it) the capture is strict for this
        thread only: ProcessGroupNCCL's watchdog thread keeps querying the events of earlier collectives meanwhile,
        which a capture strict for every thread would count as an error."""
        graph = torch.cuda.CUDAGraph()
        mode = "thread_local" if collectives else "global"
        with torch.cuda.device(device), torch.cuda.graph(graph, capture_error_mode=mode):
            fn()
        return graph

    def replay(self, graph: Any) -> None:
        graph.replay()
