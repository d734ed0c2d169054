"""kitsune's code that ``torch.compile`` meets: run as it is, outside the trace.

A kitsune step launches its own fused kernels and replays its own CUDA graph, checks addresses in native code and
keeps counters on the host: torch.compile cannot trace it, and compiling it would add nothing. torch.optim marks
its own ``zero_grad``, ``state_dict``, ``load_state_dict`` and ``add_param_group`` the same way (its ``step`` is
traced, which kitsune's cannot be). So a compiled training step (``torch.compile`` around forward, backward and
``optimizer.step()``) or torch's recipe of a compiled ``opt.step()`` breaks its graph at the call and runs kitsune's
step as it runs without the compiler; with ``fullgraph=True`` torch.compile raises, naming `REASON`.

The hooks and callbacks autograd calls during ``backward()`` (updates inside backward, ZeRO's reductions) are the
other way in: a ``backward()`` inside a traced function runs where torch.compile broke its graph, and a hook that
autograd calls from that thread (a CPU param's, or the callback at backward's end) would be traced as a function of
its own; a module hook (ZeRO's wait for the params' all-gather) would be traced into a compiled model's forward.

`never_traced` is the one way kitsune marks all of them, once, where they are defined or made: no cost to a call
(a check of ``torch.compiler.is_compiling()`` at every step cost 0.16 us on a 2-core CPU host, a wrapper such as
``torch.compiler.disable``'s 0.35-0.46 us more), and importing kitsune does not import torch._dynamo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

try:  # torch.compile's per-code setting, in torch's C extension (loaded with torch; not torch._dynamo)
    from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy

    _SKIP_ALL: Any = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
except ImportError:  # pragma: no cover - a torch built without torch.compile, or one that moved the setting
    set_code_exec_strategy = _SKIP_ALL = None

REASON = (
    "kitsune's optimizer runs its own fused kernels and CUDA graphs, outside torch.compile's graph: compile the model "
    "(torch.compile(model)) or the loop without fullgraph=True, and kitsune's step runs as it is, a graph break"
)


def never_traced(fn: F) -> F:
    """``fn``, marked so that torch.compile neither traces it nor what it calls: where a traced function calls it
    (``optimizer.step()`` in a compiled training step, a module hook in a compiled forward: a graph break at the
    call, then the call as it is), and where it runs as a function of its own (a hook autograd calls inside a traced
    function's ``backward()``). Every function made by the same ``def`` shares the first mark below; each function
    object takes the second.

    The marks are torch.compile's own: its per-code setting (``set_code_exec_strategy``, not public: skip the frame
    and every frame it calls) and the attribute ``torch.compiler.disable`` sets (``fullgraph=True`` raises, naming
    `REASON`). Both are read only while torch.compile is set to trace. A torch without the first marks nothing, and
    torch.compile traces kitsune there."""
    if set_code_exec_strategy is None:
        return fn
    target = getattr(fn, "__func__", fn)  # a bound method: its function
    set_code_exec_strategy(target.__code__, _SKIP_ALL)
    target._torchdynamo_disable = True
    target._torchdynamo_disable_msg = REASON
    return fn
