"""Muon on the fusion planner: the ``triton_matmul`` route, its cost, and its executor `MuonUnit`.

A Muon bucket (params of one device and dtype whose groups share the Newton-Schulz settings, nesterov and
``adjust_lr_fn``) runs per step as

1. one multi-tensor launch (`kitsune.kernels.muon_update.muon_update`, stage 0): the momentum buffers, and
   each param's update, in bf16, into its slot of a ``(batch, rows, cols)`` buffer per matrix shape;
2. one [`kitsune.kernels.newton_schulz.newton_schulz`][kitsune.kernels.newton_schulz.newton_schulz] call per shape, each
   ``1 + 3 * ns_steps`` launches over all of that shape's matrices; with several shapes on CUDA the calls run on side
   streams (``StreamConfig.compute_streams``, else all ``num_streams``), the largest first on the least loaded stream;
3. one multi-tensor launch (stage 1): decoupled weight decay and ``p -= lr * ratio * O``.

State is torch's: ``momentum_buffer`` in the wrapped optimizer's ``state`` (zeros on a param's first grad, as
torch creates it), so checkpoints move between kitsune and torch.optim.Muon both ways. lr, momentum and
weight_decay come from the device-resident hyperparameter buffer, so an LR scheduler changes no compiled code.
A 4-D conv weight (kitsune.optim.Muon) is the ``(out, in * kh * kw)`` matrix of its memory, as the eager path
reshapes it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from kitsune.config import FusionConfig, StreamConfig
from kitsune.fusion.algos import AlgoInfo
from kitsune.fusion.plan import BucketPlan, CostModel, Route
from kitsune.fusion.units import FusedUnit
from kitsune.kernels.coefficients import MUON_COEFFICIENTS
from kitsune.kernels.multi_tensor import DEFAULT_BLOCK
from kitsune.kernels.spec import MuonSpec
from kitsune.optim.muon import adjust_lr

Members = Sequence[tuple[int, torch.Tensor]]  # (group index, param)


def matrix_shape(p: torch.Tensor) -> tuple[int, int]:
    """The matrix Muon orthogonalises: ``(rows, everything else)``."""
    return p.shape[0], math.prod(p.shape[1:])


def adjust_ratio(adjust_lr_fn: str | None, shape: tuple[int, int]) -> float:
    """torch.optim.Muon's factor on lr for an ``(A, B)`` matrix: the eager step's `kitsune.optim.muon.adjust_lr` of
    lr 1 (1.0 for a function it does not know), and 1.0 for a matrix without columns, whose update is empty."""
    return adjust_lr(1.0, adjust_lr_fn, shape) if shape[1] else 1.0


def shape_launches(params: Sequence[torch.Tensor], steps: int) -> dict[tuple[int, int], int]:
    """Per matrix shape of ``params``: the launches of its one Newton-Schulz call on the batch of that shape
    (`kitsune.kernels.newton_schulz.launch_count`)."""
    from kitsune.kernels.newton_schulz import launch_count

    counts: dict[tuple[int, int], int] = {}
    for p in params:
        shape = matrix_shape(p)
        counts[shape] = counts.get(shape, 0) + 1
    return {s: launch_count((b, *s), steps, params[0].device) for s, b in counts.items()}


def chunks(members: Members, max_fusion_size: int | None) -> list[Members]:
    """The bucket's launch units: ``max_fusion_size`` params each (all of them when None)."""
    size = max_fusion_size or max(len(members), 1)
    return [members[i : i + size] for i in range(0, len(members), size)]


def _each(counts: Sequence[int]) -> str:
    """The launches of a call per shape, as the plan's reason words them: one number, or a range where shapes differ
    (a split Gram launches once more per iteration)."""
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def unit_launches(counts: dict[tuple[int, int], int]) -> int:
    """Launches of one unit per step, from its `shape_launches`: two elementwise ones and one Newton-Schulz call per
    matrix shape."""
    return 2 + sum(counts.values())


def group_reason(spec: MuonSpec, config: FusionConfig) -> tuple[Route, str] | None:
    """Why a Muon group cannot take the fused route whatever its params, or None."""
    if not config.enable_matmul:
        return Route.BASE_STEP, (
            "enable_matmul=False: Muon's Newton-Schulz matmuls are not fused, so the optimizer's own step runs"
        )
    if spec.ns_plan is None:
        return Route.BASE_STEP, (
            "ns_coefficients or ns_steps the optimizer's own step rejects (torch.optim.Muon takes one (a, b, c) "
            "triple, kitsune.optim.Muon also one per iteration; ns_steps an int below 100): its own step runs"
        )
    if spec.maximize:
        return Route.BASE_STEP, "maximize=True: the fused Muon kernels descend only, so the optimizer's own step runs"
    return None


def plan_bucket(bp: BucketPlan, members: Members, spec: MuonSpec, config: FusionConfig, cost: CostModel) -> None:
    """Route a Muon bucket whose params the fused kernels can take: ``triton_matmul`` when the cost model predicts at
    least ``min_fusion_benefit`` over the optimizer's own per-matrix loop, else that loop (``base_step``)."""
    params = [p for _, p in members]
    # torch.optim.Muon takes matrices, kitsune.optim.Muon also 4-D conv weights (as their (out, in*kh*kw) matrix)
    flat = [p for p in params if p.dim() != 2 and (spec.matrices_only or p.dim() != 4)]
    if flat:
        bp.reason = (
            f"a {flat[0].dim()}-D param in a Muon group: Muon orthogonalises matrices (kitsune.optim.Muon also 4-D "
            "conv weights), so the optimizer's own step runs (and rejects it)"
        )
        return
    steps = len(spec.ns_plan or ())
    # per unit (a chunk of the bucket): each shape's Newton-Schulz launches, for its batch in that unit
    units = [shape_launches([p for _, p in chunk], steps) for chunk in chunks(members, config.max_fusion_size)]
    launches = sum(unit_launches(u) for u in units)
    shapes = [matrix_shape(p) for p in params]
    plain = sum(steps * (4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3) for s in shapes)
    symmetric = sum(steps * (3 * min(s) ** 2 * max(s) + min(s) ** 3) for s in shapes)
    nbytes = bp.elements * params[0].element_size() * 6
    # torch's loop, per matrix: lerp (+ nesterov's), bf16 cast, norm, clamp, div, 3 products per iteration, decay, add
    torch_launches = len(params) * (7 + spec.nesterov + 3 * steps)
    ours = cost.triton(len(params), nbytes, launches) + symmetric / cost.matmul_flops
    theirs = (
        torch_launches * cost.launch_s
        + len(params) * cost.torch_host_s_per_tensor
        + nbytes / cost.bandwidth
        + plain / cost.matmul_flops
    )
    bp.predicted_speedup = round(theirs / ours, 3)
    if bp.predicted_speedup < config.min_fusion_benefit:
        bp.reason = (
            f"predicted speedup {bp.predicted_speedup:.2f}x is below min_fusion_benefit={config.min_fusion_benefit:g}"
            f"; {bp.optimizer} has no torch fused/foreach path on {bp.device}"
        )
        return
    n_shapes = len(set(shapes))
    bp.route, bp.launches = Route.TRITON_MATMUL, launches
    bp.reason = (
        f"momentum and update in fused multi-tensor kernels; Newton-Schulz batched by shape ({n_shapes} shape(s), "
        f"{_each([n for u in units for n in u.values()])} launches each)"
    )
    if n_shapes > 1 and bp.device.startswith("cuda"):
        bp.reason += " on side streams"


class MuonUnit(FusedUnit):
    """Up to ``max_fusion_size`` params of a Muon bucket: two multi-tensor launches around one Newton-Schulz call
    per matrix shape (see the module docstring).

    The grad, param and state bookkeeping is `FusedUnit`'s (None grads skip a param, state is created on a
    param's first grad, a moved param's storage re-plans); the Newton-Schulz buffers are this unit's own.
    """

    def __init__(
        self,
        params: list[torch.Tensor],
        group_index: list[int],
        info: AlgoInfo,
        spec: MuonSpec,
        state: Any,
        streams: StreamConfig | None = None,
        block: int = DEFAULT_BLOCK,
        seed: int = 0,
    ) -> None:
        super().__init__(params, group_index, info, spec, state, block)  # type: ignore[arg-type]
        self.seed = seed
        """``FusionConfig.rounding_seed``, for stochastic rounding (``spec.stochastic``)."""
        self._count = torch.zeros((), dtype=torch.int64, device=self.device) if spec.stochastic else None
        """Steps this unit ran: stochastic rounding's random stream (kitsune's own, not in the checkpoint, as torch's
        Muon keeps no step count)."""
        shapes = [matrix_shape(p) for p in params]
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, shape in enumerate(shapes):
            by_shape.setdefault(shape, []).append(i)
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []
        """Per matrix shape: the Newton-Schulz input and output, ``(batch, rows, cols)`` bf16."""
        update, ortho = [0] * len(params), [0] * len(params)
        for (rows, cols), members in by_shape.items():
            # zeros: a slot whose param has no grad yet is orthogonalised too (and its result unused), never NaN
            inp = torch.zeros((len(members), rows, cols), dtype=torch.bfloat16, device=self.device)
            out = torch.zeros_like(inp)
            for j, i in enumerate(members):
                update[i], ortho[i] = inp[j].data_ptr(), out[j].data_ptr()
            self.batches.append((inp, out))
        self.tables.set_role("update", update)
        self.tables.set_role("ortho", ortho)
        ratios = [adjust_ratio(spec.adjust_lr_fn, s) for s in shapes]
        self.ratio = torch.tensor(ratios, dtype=torch.float64).to(self.device)  # (T,) float64 adjust_lr factors
        self.steps = len(spec.ns_plan or ())
        self.launches = unit_launches(shape_launches(params, self.steps))
        """Launches per step while any grad is live."""
        self._stream_config = streams
        self._streams: list[torch.cuda.Stream] | None = None
        self._stream_ids: list[int] = []
        self.num_streams = 1
        """Streams the Newton-Schulz calls spread over: more than one only on CUDA with several calls."""
        self.graph_calls = [
            part for inp, out in self.batches for part in zip(*_cut(inp, out, self.device), strict=True)
        ]
        """The Newton-Schulz calls of a CUDA graph's steps: each shape's batch, the large ones cut in two."""
        self._orders: dict[bool, list[tuple[int, int]]] = {False: [], True: []}  # graphed -> (call, stream)
        if self.device.type == "cuda" and len(self.graph_calls) > 1 and streams is not None:
            ids = streams.compute_streams or list(range(streams.num_streams))
            self.num_streams = min(len(ids), len(self.graph_calls))
            self._stream_ids = ids[: self.num_streams]
            for graphed, calls in ((False, self.batches), (True, self.graph_calls)):
                n = min(self.num_streams, len(calls))
                if n > 1:
                    self._orders[graphed] = _balance([b[0].numel() * min(b[0].shape[1:]) for b in calls], n)

    def launch(
        self, hyper: torch.Tensor, found_inf: torch.Tensor | None = None, zero_grad: bool = False, graphed: bool = False
    ) -> None:
        """This step's device work: momentum, the Newton-Schulz calls, the update (``hyper``: the device context).
        ``graphed``: the work of a CUDA graph's steps (warm-up, capture, replay), which make `graph_calls`."""
        from kitsune.kernels.muon_update import muon_update

        muon_update(self.tables, hyper, self.spec, self.dtype, 0, self.ratio, found_inf, zero_grad)  # type: ignore[arg-type]
        self._orthogonalise(graphed)
        if self._count is not None:
            self._count.add_(1)  # on the device: a CUDA graph's replays count too
        muon_update(
            self.tables, hyper, self.spec, self.dtype, 1, self.ratio, found_inf, seed=self.seed, count=self._count
        )  # type: ignore[arg-type]

    def compile(self, hyper: torch.Tensor, found_inf: torch.Tensor | None = None, zero_grad: bool = False) -> None:
        """Compile what `launch` runs, changing no param or state: the momentum and update kernels compiled (not run),
        the Newton-Schulz calls of both call lists run on the unit's own buffers (their kernels compile at a launch,
        shape by shape; the buffers are scratch between steps). Raises `kitsune.kernels.common.CompileError`. On a
        CPU (Triton's interpreter compiles nothing) the Newton-Schulz calls run only with `NS_AHEAD_ON_CPU`."""
        from kitsune.kernels.common import compiling
        from kitsune.kernels.muon_update import muon_update
        from kitsune.kernels.newton_schulz import newton_schulz

        tables, spec, dtype = self.tables, self.spec, self.dtype
        muon_update(tables, hyper, spec, dtype, 0, self.ratio, found_inf, zero_grad, compile_only=True)  # type: ignore[arg-type]
        muon_update(
            tables, hyper, spec, dtype, 1, self.ratio, found_inf, seed=self.seed, count=self._count, compile_only=True
        )  # type: ignore[arg-type]
        if self.device.type != "cuda" and not NS_AHEAD_ON_CPU:
            return
        coefficients = list(spec.ns_plan or ()) or [MUON_COEFFICIENTS]  # type: ignore[union-attr]
        calls = {id(inp): (inp, out) for inp, out in (*self.batches, *self.graph_calls)}  # (uncut: the same tensors)
        for inp, out in calls.values():
            with compiling(f"newton_schulz {tuple(inp.shape)}"):
                newton_schulz(inp, self.steps, coefficients, spec.eps, out=out, graph=False)  # type: ignore[union-attr]

    def _orthogonalise(self, graphed: bool) -> None:
        from kitsune.kernels.newton_schulz import newton_schulz

        spec: MuonSpec = self.spec  # type: ignore[assignment]
        coefficients = list(spec.ns_plan or ()) or [MUON_COEFFICIENTS]  # 0 iterations: normalisation only
        # launched directly, each extra call costs host time the GPU waits on; in a CUDA graph the halves of a large
        # batch overlap each other's last, partial wave of tiles. The graph's eager warm-up steps make the same calls
        # as its capture: a kernel variant first met inside a capture would compile there, and the capture fail.
        # They launch directly: a graph of their own (newton_schulz's cache) would never replay, only hold memory
        graphed = graphed and self.device.type == "cuda"
        capturing = graphed and torch.cuda.is_current_stream_capturing()
        calls = self.graph_calls if graphed else self.batches
        order = self._orders[graphed]
        if not order:
            for inp, out in calls:
                newton_schulz(inp, self.steps, coefficients, spec.eps, out=out, graph=not graphed)
            return
        cfg = self._stream_config
        if self._streams is None:
            high = set(cfg.priority_streams) if cfg else set()
            self._streams = [torch.cuda.Stream(self.device, priority=-1 if i in high else 0) for i in self._stream_ids]
        streams = self._streams[: max(s for _, s in order) + 1]
        main = torch.cuda.current_stream(self.device)
        for stream in streams:  # the updates stage 0 wrote are ready before any side stream reads them
            stream.wait_stream(main)
        try:
            for b, s in order:
                inp, out = calls[b]
                stream = streams[s]
                with torch.cuda.stream(stream):
                    newton_schulz(inp, self.steps, coefficients, spec.eps, out=out, graph=not graphed)
                if not capturing:  # made on the main stream, used on this one: not reused before this one is done
                    inp.record_stream(stream)
                    out.record_stream(stream)
        finally:  # stage 1 reads every output; a call that raised: the ones queued before it are done first
            for stream in streams:
                main.wait_stream(stream)


NS_AHEAD_ON_CPU = False
"""Whether `MuonUnit.compile` runs the Newton-Schulz calls on a CPU too: Triton's interpreter compiles nothing, and
the calls would only cost time (a test sets it to follow a failing call)."""

CUT_MIN_TILES = 132
"""A batch of same-shape matrices is cut in two for a CUDA graph's steps when each half still has at least this many
128 x 256 output tiles (about a wave on an H100): two half-batch calls on two streams fill each other's last wave."""


def _cut(inp: torch.Tensor, out: torch.Tensor, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``inp`` and ``out`` as the calls a CUDA graph's step makes: halves (contiguous views along the batch) for a large
    batch on CUDA, themselves otherwise."""
    batch, rows, cols = inp.shape
    m, n = min(rows, cols), max(rows, cols)
    tiles = (batch // 2) * -(-m // 128) * -(-n // 256)
    if device.type != "cuda" or batch < 2 or tiles < CUT_MIN_TILES:
        return [inp], [out]
    half = batch // 2
    return [inp[:half], inp[half:]], [out[:half], out[half:]]


def _balance(costs: list[int], n: int) -> list[tuple[int, int]]:
    """``(item, bin)`` pairs: the most costly item first, each on the least loaded of ``n`` bins."""
    loads = [0] * n
    order = []
    for item in sorted(range(len(costs)), key=lambda i: -costs[i]):
        s = loads.index(min(loads))
        loads[s] += costs[item]
        order.append((item, s))
    return order
