"""kitsune's calls made inside a function that ``torch.compile`` traces: run as they are, outside the trace.

A kitsune step launches its own fused kernels and replays its own CUDA graph, checks addresses in native code and
keeps counters on the host: torch.compile cannot trace it, and compiling it would add nothing. torch.optim marks
its own ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``add_param_group`` the same way (its ``step`` is
traced, which kitsune's cannot be). So a compiled training step (``torch.compile`` around forward, backward and
``optimizer.step()``) or torch's recipe of a compiled ``opt.step()`` breaks its graph at the call and runs kitsune's
step as it runs without the compiler; with ``fullgraph=True`` torch.compile raises, naming the reason below.

The methods ask `torch.compiler.is_compiling` first (0.16 us a call on a 2-core CPU host; torch's own marking, a
wrapper around every call, costs 0.35-0.46 us more there): True only while torch.compile traces them, when they
call `outside_compile`'s function, which torch.compile does not trace into (``torch.compiler.disable``, made at
the first call so that importing kitsune does not import torch._dynamo).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REASON = (
    "kitsune's optimizer runs its own fused kernels and CUDA graphs, outside torch.compile's graph: compile the model "
    "(torch.compile(model)) or the loop without fullgraph=True, and kitsune's step runs as it is, a graph break"
)


def outside_compile(fn: Callable[..., Any], reason: str = REASON) -> Callable[..., Any]:
    """``fn`` for a caller that torch.compile traces: torch.compile breaks its graph at the call, and ``fn`` runs as
    without the compiler (nothing it calls is traced)."""
    disabled: list[Callable[..., Any]] = []

    def outside(*args: Any, **kwargs: Any) -> Any:
        if not disabled:  # torch._dynamo is imported: torch.compile is running
            import torch._dynamo

            disabled.append(torch._dynamo.disable(fn, reason=reason))
        return disabled[0](*args, **kwargs)

    # what torch.compiler.disable marks a function with: torch.compile does not trace into ``outside`` (its graph
    # breaks at the call, or with fullgraph=True it raises, naming ``reason``)
    outside._torchdynamo_disable = True  # type: ignore[attr-defined]
    outside._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    outside.__name__ = getattr(fn, "__name__", "outside")
    outside.__qualname__ = getattr(fn, "__qualname__", outside.__name__)
    return outside
