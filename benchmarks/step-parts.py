"""Where the one-line step's host time goes, part by part, on the graph's steady replay: with the grads kept, with
grads that move every step (a training loop's ``zero_grad()`` then backward) and with an LR scheduler stepped
before every step (new hyperparameters each step), in one process.

    python benchmarks/step-parts.py --json step-parts.json     # on a GPU: gpt2 and many, full size
    python benchmarks/step-parts.py --device cpu               # a dry run at tiny scale, the graph backend stood in

``KitsuneOptimizer(torch.optim.AdamW(params), enable_fusion=True)`` over each set's params, run in alternating blocks
of ``--steps`` steps a mode (``kept``: the same grads; ``fresh``: `kitsune.bench.params.fresh_grads` before each
step, outside the timer; ``sched``: kept grads and `LambdaLR` stepped before each step, outside the timer). Each
step starts with the device idle, as `kitsune bench`'s host column, or with ``--back-to-back`` right after the last
(the device may still run earlier steps, as in a training loop without a sync). The parts are the step's own
methods, each timed around its call (a wrapper costs about 0.1 us):

* ``follow``: the native check of every param and grad and, where the grads moved, the grad tables pointed at them
  (`FusionSubsystem.follow`); ``upload``, inside it: the tables' uploads (`TensorTables.set_role`);
* ``values``: a changed group's switches checked and the hyperparameters uploaded (`FusionSubsystem.refresh_values`);
  ``switches`` and ``hyper``, inside it: the switches' check (`FusionSubsystem._switches_changed`) and the rows'
  upload (`DeviceContext._upload`: the array, its page-locked slot, the copy);
* ``layout``: the kernel variants the moved grads' addresses pick (`FusionSubsystem.grad_layout`);
* ``replay``: the graph's launch (`GraphBackend.replay`);
* ``rest``: the step less ``follow``, ``values``, ``layout`` and ``replay`` (the groups' comparison, the step's
  bookkeeping).

Printed per set and mode: the median of each part over the blocks' medians, in us.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--device", default="cuda")
if _pre.parse_known_args(sys.argv[1:])[0].device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's import: a CPU plan is fused only interpreted

import torch  # noqa: E402

from kitsune import KitsuneOptimizer, __version__  # noqa: E402
from kitsune.bench.cli import add_device_args, device_and_defaults, write_script_json  # noqa: E402
from kitsune.bench.params import fresh_grads, get_param_set, make_params  # noqa: E402
from kitsune.bench.timing import native_check_ready, percentile, synchronize  # noqa: E402
from kitsune.fusion.context import DeviceContext  # noqa: E402
from kitsune.fusion.executor import FusionSubsystem  # noqa: E402
from kitsune.kernels.multi_tensor import TensorTables  # noqa: E402

MODES = ("kept", "fresh", "sched")
PARTS: dict[str, tuple[Any, str] | str] = {
    "follow": (FusionSubsystem, "follow"),
    "upload": (TensorTables, "set_role"),
    "values": (FusionSubsystem, "refresh_values"),
    "switches": (FusionSubsystem, "_switches_changed"),
    "hyper": (DeviceContext, "_upload"),
    "layout": (FusionSubsystem, "grad_layout"),
    "replay": "replay",  # the graph subsystem's backend object's
}
TOP = ("follow", "values", "layout", "replay")
"""The parts that do not nest in one another: ``rest`` is the step less these."""


@contextmanager
def timed_parts(spent: dict[str, float], backend: Any) -> Iterator[None]:
    """Wrap each of `PARTS` (a class's method, or ``backend``'s) so that its calls add their time (ns) to
    ``spent[part]``; unwrapped on exit."""
    saved = []
    for part, where in PARTS.items():
        owner, name = (backend, where) if isinstance(where, str) else where
        real = getattr(owner, name)

        def wrapper(*args: Any, _real: Callable = real, _part: str = part, **kwargs: Any) -> Any:
            t0 = time.perf_counter_ns()
            try:
                return _real(*args, **kwargs)
            finally:
                spent[_part] += time.perf_counter_ns() - t0

        setattr(owner, name, functools.wraps(real)(wrapper))
        saved.append((owner, name, real))
    try:
        yield
    finally:
        for owner, name, real in saved:
            if owner is backend:
                delattr(owner, name)  # the class's method again
            else:
                setattr(owner, name, real)


def stand_in_graphs(opt: KitsuneOptimizer) -> None:
    """On a CPU: `benchmarks/host-path.py`'s graph backend, whose capture and replay do nothing, so that the steps
    take the steady replay's host path."""
    spec = importlib.util.spec_from_file_location("host_path", Path(__file__).with_name("host-path.py"))
    host_path = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.path.insert(0, str(Path(__file__).parent))  # host-path.py imports ab.py
    spec.loader.exec_module(host_path)  # type: ignore[union-attr]
    graphs = opt._subsystem("graphs")
    graphs.backend = host_path.StandInGraphs()
    opt._replan()
    if not graphs.active:
        raise SystemExit(f"the graph subsystem is inactive: {graphs.reason}")


def block(
    opt: KitsuneOptimizer, params: list, sched: Any, mode: str, steps: int, gen: Any, device: Any, idle: bool = True
) -> dict:
    """One block of ``steps`` steps in ``mode``: each part's median (us) over its steps, and the steady replays.
    ``idle``: each step starts with the device idle (else back to back: the device may still run earlier steps)."""
    graphs = opt._subsystem("graphs")
    steady = graphs.steady_replays
    rows: dict[str, list[float]] = {part: [] for part in (*PARTS, "rest", "step")}
    for _ in range(steps):
        if mode == "fresh":
            fresh_grads(params, gen)
        elif mode == "sched":
            sched.step()
        if idle:
            synchronize(device)
        spent = dict.fromkeys(PARTS, 0.0)
        with timed_parts(spent, graphs.backend):
            t0 = time.perf_counter_ns()
            opt.step()
            total = time.perf_counter_ns() - t0
        for part, ns in spent.items():
            rows[part].append(ns / 1e3)
        rows["step"].append(total / 1e3)
        rows["rest"].append((total - sum(spent[p] for p in TOP)) / 1e3)
    synchronize(device)
    out = {part: percentile(v, 50) for part, v in rows.items()}
    out["steady"] = graphs.steady_replays - steady
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--sets", default="gpt2,many", help="comma-separated kitsune bench sets")
    parser.add_argument("--rounds", type=int, default=None, help="blocks of each mode (default 10; 2 on a CPU)")
    parser.add_argument("--steps", type=int, default=20, help="steps a block")
    parser.add_argument(
        "--back-to-back",
        action="store_true",
        help="do not wait for the device before each step: the GPU may still run the last steps' work, as in a "
        "training loop without a sync (default: each step starts with the device idle)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = device_and_defaults(parser, args, rounds=(2, 10))
    print(f"torch {torch.__version__}, kitsune {__version__}, x {args.scale:g}; {args.rounds} blocks of each mode")
    if device.type == "cpu":  # the stood-in steady replay runs the native check too
        from kitsune import _native

        print(f"native address check: {'ready' if _native.wait(600) is not None else _native.reason()}")
    else:
        print(native_check_ready(device))
    out: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k != "json"}}
    for set_name in args.sets.split(","):
        params = make_params(get_param_set(set_name, args.scale), device, seed=0)
        opt = KitsuneOptimizer(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01), enable_fusion=True)
        if device.type == "cpu":
            stand_in_graphs(opt)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)
        gen = torch.Generator(device=device).manual_seed(1)
        for _ in range(12):  # warm-up, capture, then the steady replay
            fresh_grads(params, gen)
            opt.step()
        blocks: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                blocks[mode].append(block(opt, params, sched, mode, args.steps, gen, device, not args.back_to_back))
        out[set_name] = {}
        for mode, rows in blocks.items():
            median = {key: percentile([b[key] for b in rows], 50) for key in rows[0]}
            out[set_name][mode] = {"median": median, "blocks": rows}
            parts = ", ".join(f"{part} {median[part]:.1f}" for part in (*PARTS, "rest"))
            print(
                f"{set_name:5s} {mode:5s}: step {median['step']:.1f} us ({parts}); steady replays "
                f"{median['steady']:.0f} of {args.steps}"
            )
        del opt, params
    if args.json is not None:
        write_script_json(args.json, device, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
