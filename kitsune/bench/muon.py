"""Muon benchmark: kitsune's Triton Newton-Schulz against torch.optim.Muon's, and a Muon step against torch's.

>>> from kitsune.bench.muon import run_muon_bench
>>> result = run_muon_bench("cuda")  # doctest: +SKIP

FLOPs: an iteration on an ``(m, n)`` matrix, ``m <= n``, is three products. The plain algorithm (torch's) does
``2 m^2 n`` (``X X^T``) + ``2 m^3`` (``A A``) + ``2 m^2 n`` (``B X``); the symmetric one (kitsune's) computes only
the upper triangle of the two symmetric products: ``m^2 n + m^3 + 2 m^2 n``, two thirds for a square matrix. The
table reports torch's function called directly (as torch.optim.Muon calls it) and replayed from a CUDA graph (as
kitsune's `newton_schulz` replays its launches), each implementation's rate on the FLOPs it executes (plain for
torch, symmetric for kitsune, whose % of the dense bf16 matmul rate is measured in the same run), and kitsune's
"effective" rate, the plain FLOPs over its time: the rate a plain implementation would need to match it. Every
time is the median of back-to-back calls, as an optimizer makes them step after step (no cache flush between calls).

The Muon step is timed three ways on the same params and grads: torch.optim.Muon, kitsune.optim.Muon, and
torch.optim.Muon wrapped in ``KitsuneOptimizer(..., enable_fusion=True)``, which the fusion planner runs on its
``triton_matmul`` route (momentum and update in multi-tensor kernels, one batched Newton-Schulz call per shape).
Every row's params are checked to move on its timed steps (`kitsune.bench.peers.MoveCheck`), and the planner's row
shows its route and how many of its steps replayed the captured graph.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton
from rich.console import Console
from rich.table import Table

from kitsune import KitsuneOptimizer
from kitsune._device import parse_device
from kitsune.bench.info import StepMark, kitsune_info, route_line, step_mark
from kitsune.bench.peers import MoveCheck
from kitsune.bench.timing import percentile, time_steps
from kitsune.kernels.newton_schulz import MUON_COEFFICIENTS, newton_schulz
from kitsune.optim import Muon
from kitsune.optim.muon import zeropower_via_newtonschulz

NS_SIZES = (1024, 2048, 4096, 8192)
"""Square matrices for the Newton-Schulz rows."""
NS_STEPS = 5
MATMUL_SIZE = 8192
"""Side of the bf16 ``torch.matmul`` whose rate is the 100% of the table."""
STEP_SHAPES = [(2048, 2048)] * 8
"""The Muon step's params: 8 matrices of 2048 x 2048, fp32."""
MUON_KWARGS: dict[str, Any] = {"lr": 0.02, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True}


_TORCH_MUON = getattr(torch.optim, "Muon", None)  # torch >= 2.9


def _planner(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    return KitsuneOptimizer(_TORCH_MUON(params, **MUON_KWARGS), enable_fusion=True)


Factory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
STEP_VARIANTS: dict[str, tuple[str, Factory | None]] = {
    "torch": ("torch.optim.Muon", (lambda ps: _TORCH_MUON(ps, **MUON_KWARGS)) if _TORCH_MUON else None),
    "kitsune": ("kitsune.optim.Muon", lambda ps: Muon(ps, **MUON_KWARGS)),
    "planner": ("KitsuneOptimizer(torch.optim.Muon, enable_fusion=True)", _planner if _TORCH_MUON else None),
}
"""The Muon step's rows: name -> (label, optimizer factory, None where this torch has no torch.optim.Muon)."""


def flops(m: int, n: int, steps: int = NS_STEPS) -> tuple[int, int]:
    """(plain, symmetric) FLOPs of ``steps`` iterations on an ``(m, n)`` matrix."""
    m, n = min(m, n), max(m, n)
    return steps * (4 * m * m * n + 2 * m**3), steps * (3 * m * m * n + m**3)


def _torch_ns():
    """torch.optim.Muon's own function when this torch has it (>= 2.9); kitsune's op-for-op copy otherwise."""
    try:
        from torch.optim._muon import _zeropower_via_newtonschulz as fn

        return lambda g: fn(g, MUON_COEFFICIENTS, NS_STEPS, 1e-7)
    except ImportError:
        return lambda g: zeropower_via_newtonschulz(g, [MUON_COEFFICIENTS] * NS_STEPS, 1e-7)


def _ms(fn: Callable[[], object], warmup_ms: float = 25.0, rep_ms: float = 200.0) -> float:
    """Median ms of back-to-back calls, each between two CUDA events, as an optimizer calls it step after step (no
    cache flush between calls), after about ``warmup_ms`` of warm-up calls; about ``rep_ms`` of timed calls, at
    least 10 and at most 1000."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    each = max((time.perf_counter() - t0) * 1e3 / 3, 1e-3)
    for _ in range(min(1000, int(warmup_ms / each))):
        fn()
    calls = max(10, min(1000, int(rep_ms / each)))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(calls)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return percentile([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)], 50)


def _graphed(fn: Callable[[torch.Tensor], object], g: torch.Tensor) -> Callable[[], None]:
    """``fn(g)`` captured in a CUDA graph, torch's recipe (warm-up calls on a side stream first): its replay. kitsune's
    `newton_schulz` replays graphs of its own launches, so its rows are compared with torch's function replayed too,
    where no host launches the kernels one by one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(g)
    finally:  # a call that raised: the next row's timing does not start under what it queued
        torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(g)
    return graph.replay


class _Stepper(NamedTuple):
    opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    check: MoveCheck
    """Snapshots of the params around the timed steps: each row's params must move (`MoveCheck`)."""
    mark: StepMark | None
    """A `KitsuneOptimizer`'s steps and graph replays after warm-up (None: another optimizer)."""


def _warm_stepper(make: Factory, device: torch.device, gen: torch.Generator) -> _Stepper:
    """An optimizer from ``make`` over fresh ``STEP_SHAPES`` params with random grads, after three steps (compile,
    create state, capture)."""
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen)) for s in STEP_SHAPES]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=gen)
    opt = make(params)
    for _ in range(3):
        opt.step()
    mark = step_mark(opt) if isinstance(opt, KitsuneOptimizer) else None
    return _Stepper(opt, params, MoveCheck(params, [f"param {i}" for i in range(len(params))]), mark)


STEP_ROUNDS = 6
"""Rounds of the Muon step's timing; each round times every optimizer, in an order rotated round by round."""


def _muon_step(device: torch.device, steps: int, rounds: int = STEP_ROUNDS) -> dict[str, Any]:
    """Time each optimizer of `STEP_VARIANTS` over ``STEP_SHAPES``: ``rounds`` rounds, each optimizer in each
    place of a round's order alike, each timed after as many untimed steps of its own (a GPU's clocks follow the power
    drawn just before: a step timed right after torch.optim.Muon's host-bound steps ran ~10% faster on an H100 than
    one timed after another kitsune step). ``steps`` timed steps per optimizer in all."""
    gen = torch.Generator(device).manual_seed(0)
    results: dict[str, Any] = {name: None for name in STEP_VARIANTS}
    steppers = {name: _warm_stepper(make, device, gen) for name, (_, make) in STEP_VARIANTS.items() if make}
    per_round = max(1, -(-steps // rounds))
    device_ms: dict[str, list[float]] = {name: [] for name in steppers}
    host_ms: dict[str, list[float]] = {name: [] for name in steppers}
    names = list(steppers)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            stepper = steppers[name]
            for _ in range(per_round):
                stepper.opt.step()
            times = time_steps(stepper.opt.step, per_round, device, check=stepper.check)
            device_ms[name] += times.device_ms
            host_ms[name] += times.host_ms
    for name, stepper in steppers.items():
        stepper.check.verify()  # ParamsDidNotMove: a step that changed nothing has no row
        results[name] = {"device_ms": percentile(device_ms[name], 50), "host_ms": percentile(host_ms[name], 50)}
        if stepper.mark is not None:  # what the fusion planner ran: a fallback or eager steps show in the table
            info = kitsune_info(stepper.opt, len(stepper.params), since=stepper.mark)
            results[name]["route"] = route_line(info)
            results[name]["fused_all"] = info.fused_all
    del steppers  # the optimizers, their params and state: nothing else holds them
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if results["torch"] is not None:
        results["speedup"] = results["torch"]["device_ms"] / results["kitsune"]["device_ms"]
        results["planner_speedup"] = results["torch"]["device_ms"] / results["planner"]["device_ms"]
    return results


def run_muon_bench(device: torch.device | str, console: Console | None = None, step_reps: int = 30) -> dict[str, Any]:
    """Time Newton-Schulz (5 iterations, bf16, square ``NS_SIZES``) and a Muon step over ``STEP_SHAPES``.

    Returns the numbers (ms, TFLOP/s, speedups) as a dict and prints a table on ``console``. GPU only: another
    device, or none where torch sees no GPU, raises a ValueError.
    """
    device = parse_device(str(device))  # an unknown name, CUDA without a GPU, cuda:N past the GPUs: its ValueError
    if device.type != "cuda":
        seen = "" if torch.cuda.is_available() else f", and torch {torch.__version__} sees none"
        raise ValueError(f"the Muon benchmark needs a CUDA GPU (it times Triton kernels); got device '{device}'{seen}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    console = console or Console()
    torch_ns = _torch_ns()
    with torch.cuda.device(device):
        mat = torch.randn(MATMUL_SIZE, MATMUL_SIZE, device=device, dtype=torch.bfloat16)
        matmul_tflops = 2 * MATMUL_SIZE**3 / _ms(lambda mat=mat: torch.matmul(mat, mat)) / 1e9
        del mat
        rows = []
        for n in NS_SIZES:
            g = torch.randn(n, n, device=device)  # an fp32 momentum buffer, as the optimizer hands it over
            torch_ms = _ms(lambda g=g: torch_ns(g))
            torch_graph_ms = _ms(_graphed(torch_ns, g))
            kitsune_ms = _ms(lambda g=g: newton_schulz(g, NS_STEPS))
            plain, sym = flops(n, n)
            rows.append(
                {
                    "size": n,
                    "torch_ms": torch_ms,
                    "torch_graph_ms": torch_graph_ms,
                    "kitsune_ms": kitsune_ms,
                    "speedup": torch_ms / kitsune_ms,
                    "speedup_over_graph": torch_graph_ms / kitsune_ms,
                    "flops_plain": plain,
                    "flops_symmetric": sym,
                    "torch_tflops": plain / torch_ms / 1e9,
                    "kitsune_tflops": sym / kitsune_ms / 1e9,
                    "kitsune_effective_tflops": plain / kitsune_ms / 1e9,
                    "kitsune_pct_of_matmul": 100 * sym / kitsune_ms / 1e9 / matmul_tflops,
                }
            )
            del g
        step = _muon_step(device, step_reps)
    result = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "matmul_tflops": matmul_tflops,
        "newton_schulz": rows,
        "muon_step": step,
    }
    print_muon_results(result, console)
    return result


def print_muon_results(result: dict[str, Any], console: Console) -> None:
    table = Table(
        title=f"Newton-Schulz, {NS_STEPS} iterations, bf16 ({result['device']}; bf16 matmul "
        f"{MATMUL_SIZE}^2: {result['matmul_tflops']:.0f} TFLOP/s; medians of back-to-back calls)"
    )
    for col in ("size", "torch ms", "torch graph ms", "kitsune ms", "speedup", "over the graph"):
        table.add_column(col, justify="right")
    table.add_column("torch TFLOP/s (plain)", justify="right")
    for col in ("kitsune TFLOP/s (symmetric)", "% of matmul", "kitsune effective TFLOP/s (plain)"):
        table.add_column(col, justify="right")
    for r in result["newton_schulz"]:
        table.add_row(
            f"{r['size']}^2",
            f"{r['torch_ms']:.3f}",
            f"{r['torch_graph_ms']:.3f}" if "torch_graph_ms" in r else "-",
            f"{r['kitsune_ms']:.3f}",
            f"{r['speedup']:.2f}x",
            f"{r['speedup_over_graph']:.2f}x" if "speedup_over_graph" in r else "-",
            f"{r['torch_tflops']:.0f}",
            f"{r['kitsune_tflops']:.0f}",
            f"{r['kitsune_pct_of_matmul']:.0f}%",
            f"{r['kitsune_effective_tflops']:.0f}",
        )
    console.print(table)
    step = result["muon_step"]
    shapes = f"{len(STEP_SHAPES)} x {STEP_SHAPES[0][0]}x{STEP_SHAPES[0][1]} fp32"
    table = Table(title=f"Muon step, {shapes} (median of CUDA-event times; host: the step() call alone)")
    for col in ("optimizer", "device ms", "host ms", "speedup"):
        table.add_column(col, justify="right")
    speedups = {"kitsune": step.get("speedup"), "planner": step.get("planner_speedup")}
    for name, (label, _) in STEP_VARIANTS.items():
        if step.get(name) is None:
            table.add_row(label, "n/a (torch < 2.9)", "", "")
            continue
        speed = "" if speedups.get(name) is None else f"{speedups[name]:.2f}x"
        table.add_row(label, f"{step[name]['device_ms']:.3f}", f"{step[name]['host_ms']:.3f}", speed)
    console.print(table)
    for name, (label, _) in STEP_VARIANTS.items():  # the fusion planner's route: a fallback shows here
        if step.get(name) is not None and step[name].get("route"):
            console.print(f"{label}: {step[name]['route']}", highlight=False)
