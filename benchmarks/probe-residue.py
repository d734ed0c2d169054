"""Whether the profiler's probe leaves work behind: steady steps of optimizers whose probe ran, with each of its parts
left out, against the profiler off, in one process.

python benchmarks/probe-residue.py --json probe-residue.json    # on a GPU: the many set, full size
python benchmarks/probe-residue.py --device cpu                 # a dry run at tiny scale (no probe runs on a CPU)

It builds the one-line AdamW (``KitsuneOptimizer(torch.optim.AdamW(params), enable_fusion=True)``) over copies of the
same seeded params once with the profiler off (``off``), then, one after another, with it on (`VARIANTS`): its
defaults (``on``), without the probe (``noprobe``), without the NVML sampler (``nonvml``), and with the probe's
parts left out one at a time while the optimizer warms up (``probe_notp``: torch.profiler; ``probe_nosync``: the
sync debug mode; ``probe_nobw``: the copy-bandwidth test). Each optimizer is warmed up past the sampled windows
right after it is built. First the ``off`` optimizer is timed before and after the others ran their probes (a cost
the probe leaves on the process rather than on its optimizer). Then ``--rounds`` rounds, each optimizer ``--steps``
back-to-back steps after ``gc.collect()`` in an order that rotates from round to round: microseconds a step between
two CUDA events around the block, the median host time of the block's later steps (warm) and of its first (cold).
Last, ``cProfile`` over 100 steady steps of ``off``, ``on``, ``noprobe`` and ``probe_notp``: Python calls a step and
the functions whose calls differ between them (work one of them does and the other does not). Eight optimizers in all
(``off`` twice); the profiled ones' NVML samplers (one wake-up every ``nvml_interval_s``, 0.5 s) run through every
block, so ``nonvml`` differs from ``on`` by one sampler among several, not by the sampler's whole cost.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any
from unittest import mock

import torch

from kitsune import KitsuneOptimizer, __version__
from kitsune.bench.cli import add_device_args, device_and_defaults, write_script_json
from kitsune.bench.params import get_param_set, make_params
from kitsune.bench.timing import native_check_ready, percentile, synchronize, time_block
from kitsune.config import FusionConfig, KitsuneConfig, ProfilerConfig


class _NoTorchProfiler:
    """torch.profiler.profile's stand-in: starts nothing, records nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def events(self) -> list:
        return []


VARIANTS: dict[str, tuple[dict[str, Any] | None, list[tuple[str, Any]]]] = {
    "off": (None, []),
    "on": ({}, []),
    "noprobe": ({"probe_steps": 0}, []),
    "nonvml": ({"nvml_interval_s": 0}, []),
    "probe_notp": ({}, [("torch.profiler.profile", _NoTorchProfiler)]),
    "probe_nosync": ({}, [("torch.cuda.set_sync_debug_mode", lambda *args, **kwargs: None)]),
    "probe_nobw": ({}, [("kitsune.profiler.probe.measure_copy_bandwidth", lambda *args, **kwargs: 1.0)]),
}
"""Each variant's profiler settings (None: off) and what is patched while it warms up (where its probe runs)."""


def build(name: str, args: argparse.Namespace, device: torch.device) -> KitsuneOptimizer:
    settings, patches = VARIANTS[name]
    params = make_params(get_param_set(args.set, args.scale), device, seed=0)
    profiler = {} if settings is None else {"profiler": ProfilerConfig(**settings)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU: "fusion was asked for but is inactive"
        opt = KitsuneOptimizer(torch.optim.AdamW(params), config=KitsuneConfig(fusion=FusionConfig(), **profiler))
    with ExitStack() as stack:
        for target, new in patches:
            stack.enter_context(mock.patch(target, new))
        for _ in range(args.warmup):
            opt.step()
    synchronize(device)
    return opt


def block(opt: KitsuneOptimizer, steps: int, device: torch.device) -> tuple[float, float, float]:
    """(us a step over the block, median host us of the later steps, host us of the first): `time_block`."""
    t = time_block(opt.step, steps, device)
    return t["ms"] * 1e3, t["later_ms"] * 1e3, t["first_ms"] * 1e3


def calls(opt: KitsuneOptimizer, device: torch.device, steps: int = 100) -> dict[str, tuple[int, float]]:
    """Per function (``file:line:name``): calls and seconds over ``steps`` steady steps, under cProfile."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        opt.step()
    prof.disable()
    synchronize(device)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    return {f"{k[0].rsplit('/', 1)[-1]}:{k[1]}:{k[2]}": (v[1], v[2]) for k, v in stats.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--set", default="many", help="a parameter set of kitsune bench")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 40; 2 on a CPU)")
    parser.add_argument("--steps", type=int, default=20, help="steps per optimizer a round")
    parser.add_argument("--warmup", type=int, default=30, help="steps after building (past the sampled windows)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = device_and_defaults(parser, args, rounds=(2, 40))
    print(f"torch {torch.__version__}, kitsune {__version__}, {args.set} x {args.scale:g}")
    print(native_check_ready(device))
    out: dict[str, Any] = {"config": {k: getattr(args, k) for k in ("set", "scale", "rounds", "steps", "warmup")}}

    first = build("off", args, device)
    before = [block(first, args.steps, device) for _ in range(args.rounds // 2 or 1)]
    opts = {name: build(name, args, device) for name in VARIANTS}
    after = [block(first, args.steps, device) for _ in range(args.rounds // 2 or 1)]
    out["process"] = {
        "before_us": percentile([b[0] for b in before], 50),
        "after_us": percentile([a[0] for a in after], 50),
    }
    print(
        f"off, built first: {out['process']['before_us']:.1f} us a step before the others' probes ran, "
        f"{out['process']['after_us']:.1f} after"
    )

    names = list(VARIANTS)
    times: dict[str, list[tuple[float, float, float]]] = {name: [] for name in names}
    for r in range(args.rounds):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]  # the order rotates from round to round
            times[name].append(block(opts[name], args.steps, device))
    out["variants"] = {}
    for name in names:
        step, warm, cold = ([t[k] for t in times[name]] for k in range(3))
        row = out["variants"][name] = {
            "us": percentile(step, 50),
            "us_p10": percentile(step, 10),
            "us_p90": percentile(step, 90),
            "warm_host_us": percentile(warm, 50),
            "cold_host_us": percentile(cold, 50),
        }
        print(
            f"  {name:13s} {row['us']:7.1f} us a step (p10 {row['us_p10']:.1f}, p90 {row['us_p90']:.1f}), "
            f"host warm {row['warm_host_us']:.1f}, cold {row['cold_host_us']:.1f}"
        )

    profiled = {name: calls(opts[name], device) for name in ("off", "on", "noprobe", "probe_notp")}
    out["calls_per_step"] = {name: sum(c for c, _ in p.values()) / 100 for name, p in profiled.items()}
    print(
        "  Python calls a step under cProfile: " + ", ".join(f"{k} {v:.2f}" for k, v in out["calls_per_step"].items())
    )
    out["differing_calls"] = {}
    for a, b in (("off", "on"), ("noprobe", "on"), ("noprobe", "probe_notp")):
        keys = set(profiled[a]) | set(profiled[b])
        diff = sorted(k for k in keys if profiled[a].get(k, (0, 0.0))[0] != profiled[b].get(k, (0, 0.0))[0])
        out["differing_calls"][f"{a}->{b}"] = {
            k: [profiled[a].get(k, (0, 0.0))[0], profiled[b].get(k, (0, 0.0))[0]] for k in diff
        }
        print(f"  {a} -> {b}: {len(diff)} functions called a different number of times")
        for k in diff[:12]:
            print(f"     {profiled[a].get(k, (0, 0.0))[0]} -> {profiled[b].get(k, (0, 0.0))[0]}  {k}")
    for opt in opts.values():
        if opt.profiler is not None:
            opt.profiler.close()  # the NVML sampler's thread
    if args.json is not None:
        write_script_json(args.json, device, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
