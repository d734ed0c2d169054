"""The fusion plan (what runs where, and why) and the cost model behind ``min_fusion_benefit``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any


class Route(str, Enum):
    """How a bucket's params are updated, best first."""

    TRITON = "triton"
    """kitsune's fused multi-tensor kernel."""
    TRITON_MATMUL = "triton_matmul"
    """Muon: fused multi-tensor momentum and update kernels around Triton Newton-Schulz calls batched by shape."""
    TORCH_FUSED = "torch_fused"
    """torch's own ``fused=True`` implementation of the same optimizer."""
    TORCH_FOREACH = "torch_foreach"
    """torch's ``foreach=True`` implementation."""
    BASE_STEP = "base_step"
    """The wrapped optimizer's own step (the params are left out of ``ctx.handled``)."""

    @property
    def fused(self) -> bool:
        """kitsune's own kernels update the bucket."""
        return self in (Route.TRITON, Route.TRITON_MATMUL)


@dataclass(frozen=True)
class CostModel:
    """Predicted time of one step of a bucket, per route: launches, host work per tensor, and bytes moved.

    ``time = launches * launch_s + tensors * host_s_per_tensor + bytes / bandwidth``. The constants are rough
    H100-class figures; only their ratios matter for ``min_fusion_benefit``. torch's multi-tensor apply puts at
    most ``torch_tensors_per_launch`` tensors in one launch (its 4 KB kernel-argument limit) and its foreach path
    runs ``AlgoInfo.foreach_launches`` kernels per chunk, each of which streams the data it touches again. An
    optimizer with neither (Lion, LAMB, LARS) is weighed against its own per-param loop: ``AlgoInfo.loop_launches``
    kernels per param, each launched from Python.
    """

    launch_s: float = 5e-6
    """Host + device cost of one kernel launch."""
    kitsune_host_s_per_tensor: float = 0.1e-6
    """kitsune's per-step Python work per tensor (the grad check)."""
    torch_host_s_per_tensor: float = 1.5e-6
    """torch's per-tensor host work in ``step`` (state lookup, list building, grouping)."""
    bandwidth: float = 2.0e12
    """Bytes per second the update streams at."""
    torch_tensors_per_launch: int = 48
    matmul_flops: float = 4.0e14
    """bf16 matmul FLOP/s (Muon's Newton-Schulz)."""

    def triton(self, tensors: int, nbytes: int, launches: int) -> float:
        return launches * self.launch_s + tensors * self.kitsune_host_s_per_tensor + nbytes / self.bandwidth

    def torch_fused(self, tensors: int, nbytes: int) -> float:
        chunks = max(1, math.ceil(tensors / self.torch_tensors_per_launch))
        # + one foreach launch per chunk to bump the step counts
        return 2 * chunks * self.launch_s + tensors * self.torch_host_s_per_tensor + nbytes / self.bandwidth

    def torch_foreach(self, tensors: int, nbytes: int, ops: int) -> float:
        chunks = max(1, math.ceil(tensors / self.torch_tensors_per_launch))
        # each foreach op reads its inputs and writes its output again: about 2/3 of the bytes per op
        return (
            ops * chunks * self.launch_s + tensors * self.torch_host_s_per_tensor + ops * nbytes / 1.5 / self.bandwidth
        )

    def per_param_loop(self, tensors: int, nbytes: int, ops: int) -> float:
        # a Python loop over the params: every op is its own launch for every param
        return (
            ops * tensors * self.launch_s + tensors * self.torch_host_s_per_tensor + ops * nbytes / 1.5 / self.bandwidth
        )


def speedup_text(b: dict[str, Any]) -> str:
    """A bucket's predicted speedup with the model's times behind it, e.g. ``"1.1x (1.76 vs 2 ms)"``."""
    speedup = b.get("predicted_speedup")
    if speedup is None:
        return "-"
    times = list((b.get("predicted_ms") or {}).values())
    return f"{speedup:.1f}x ({times[0]:g} vs {times[1]:g} ms)" if len(times) == 2 else f"{speedup:.1f}x"


def bucket_label(b: Mapping[str, Any]) -> str:
    """A bucket's label from its dict (`BucketPlan.to_dict`, or a saved profile's, which may lack fields), e.g.
    ``"AdamW (decoupled_wd) float32 cuda:0, 8-bit state"``: the state's format only where it is not the dtype."""
    options = "" if b.get("options") in (None, "-", "") else f" ({b['options']})"
    label = f"{b.get('optimizer', '?')}{options} {b.get('dtype', '')} {b.get('device', '')}".strip()
    state = b.get("state", "-")
    return label if state in ("-", b.get("dtype")) else f"{label}, {state} state"


@dataclass
class BucketPlan:
    """One bucket: params of one device, dtype and optimizer variant that share a route."""

    device: str
    dtype: str
    optimizer: str
    options: str
    """The compile-time switches of the fused kernel, e.g. ``"decoupled_wd, amsgrad"``."""
    route: Route
    reason: str
    """Why this route (for a fallback: why the better routes were not taken)."""
    tensors: int
    elements: int
    launches: int
    """Kernel launches per step on this route (kitsune's own; 0 for the wrapped optimizer's step)."""
    bytes_per_step: int | None = None
    """Bytes the update must read and write per step (params, grads, state) whatever the route; None for an
    optimizer kitsune does not know."""
    predicted_speedup: float | None = None
    """Cost-model speedup of the fused kernel over the best torch fallback (``None`` when not fusable at all)."""
    groups: list[int] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """Options that were looked at and are fine, e.g. ``foreach=True ignored``."""
    state: str = "-"
    """How the bucket's optimizer state is stored: its dtype (``"float32"``, ``"bfloat16"``) or ``"8-bit"``
    (``FusionConfig.state_precision``); ``"-"`` for an optimizer without state, or one kitsune does not know."""
    predicted_ms: dict[str, float] = field(default_factory=dict)
    """The cost model's time per step of the fused route and of the fallback it was weighed against, in ms, by
    route (``{"triton": 0.41, "base_step": 3.7}``); empty when nothing was weighed."""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["route"] = self.route.value
        return d


@dataclass
class Plan:
    """Which params go to which kernel, which fall back, and why. ``rich.print(plan)`` shows it as a table."""

    buckets: list[BucketPlan] = field(default_factory=list)

    def count(self, *routes: Route) -> int:
        """Tensors planned on any of ``routes``."""
        return sum(b.tensors for b in self.buckets if b.route in routes)

    @property
    def fused_tensors(self) -> int:
        return self.count(Route.TRITON, Route.TRITON_MATMUL)

    @property
    def fallback_tensors(self) -> int:
        return self.count(Route.TORCH_FUSED, Route.TORCH_FOREACH, Route.BASE_STEP)

    @property
    def launches(self) -> int:
        """Fused Triton launches per step when every grad is present."""
        return sum(b.launches for b in self.buckets if b.route.fused)

    @property
    def bytes_per_step(self) -> int | None:
        """Bytes every update of a step must move together (the bandwidth floor's numerator); None if unknown."""
        sizes = [b.bytes_per_step for b in self.buckets]
        return None if not sizes or None in sizes else sum(sizes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, Any]:
        return {
            "buckets": [b.to_dict() for b in self.buckets],
            "bytes_per_step": self.bytes_per_step,
            "fused_tensors": self.fused_tensors,
            "fallback_tensors": self.fallback_tensors,
            "launches_per_step": self.launches,
        }

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title="kitsune fusion plan")
        table.add_column("bucket")
        table.add_column("route")
        for col in ("tensors", "elements", "launches", "speedup"):
            table.add_column(col, justify="right")
        table.add_column("reason")
        for b in self.buckets:
            style = "green" if b.route.fused else "yellow"
            table.add_row(
                bucket_label(b.to_dict()),
                f"[{style}]{b.route.value}[/{style}]",
                str(b.tensors),
                f"{b.elements:,}",
                str(b.launches),
                speedup_text(b.to_dict()),
                "; ".join([b.reason, *b.notes]),
            )
        return table
