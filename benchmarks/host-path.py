"""The host's share of the one-line step on the steady replay, on a CPU, for one commit or two side by side.

The steady replay (`kitsune.graphs.GraphSubsystem.replay_steady`) is host work around one graph replay: the groups'
values compared, every param's and grad's address read in one native call, and, where the grads moved, the tables
pointed at them. All of it but the replay runs the same on a CPU, so this times it there, with no GPU: the graph
backend is a stand-in whose capture and replay do nothing (no kernel ever runs; the params never change), so what
is timed is ``step()``'s host path alone. On a GPU a replay adds its launch (a few us) and the moved grads' table
upload; `kitsune bench` and ``benchmarks/fresh-grads.py`` time those there. ``--path eager`` times the full path
instead (``capture_graph=False``, as `kitsune bench`'s ``eager`` row), its launches stubbed out.

    python benchmarks/host-path.py                                   # this commit: gpt2 and many, kept and fresh
    git archive be8fed5 kitsune | tar -x -C /tmp/other               # another commit's package
    python benchmarks/host-path.py --other /tmp/other/kitsune        # both in one process, alternating rounds
    python benchmarks/host-path.py --other /tmp/other/kitsune --other-first
    python benchmarks/host-path.py --path eager                      # capture_graph=False: the full path each step

``AdamW`` through ``KitsuneOptimizer(..., enable_fusion=True)`` over a `kitsune bench` set's tensors (``--scale``
shrinks each tensor, not their count: the host path's cost is per tensor). Grads ``kept`` (the same tensors every
step) or ``fresh`` (`kitsune.bench.params.fresh_grads` before each step, outside the timer: every grad moved, as a
training loop's); ``sched``: kept grads and an LR scheduler (`LambdaLR`) stepped before each step, outside the timer,
so that every step uploads new hyperparameters. Per round and side, the median of ``--steps`` host times; printed:
the median over the rounds. The optimizer built first can be the slower one, whichever commit it is (where the
objects a step reads land in memory): run both orders before reading a difference as a commit's.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ.setdefault("TRITON_INTERPRET", "1")  # a CPU plan is fused only through Triton's interpreter

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ab import load_other  # noqa: E402


class StandInGraphs:
    """A graph backend whose warm-up, capture and replay do nothing: only the step's host path runs."""

    def supports(self, device: torch.device) -> str | None:
        return None

    def collectives(self, groups: Any) -> str | None:
        return None

    def eager(self, fn: Any, device: torch.device) -> None:
        pass

    def capture(self, fn: Any, device: torch.device, collectives: bool = False) -> Any:
        return fn

    def replay(self, graph: Any) -> None:
        pass


def build(mod: ModuleType, set_name: str, scale: float, path: str) -> tuple[list[torch.nn.Parameter], Any, Any]:
    from kitsune.bench.params import get_param_set, make_params

    params = make_params(get_param_set(set_name, scale), "cpu", seed=0)
    adamw = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if path == "eager":  # capture_graph=False: every step the full path, its launches stubbed (see main)
        opt = mod.KitsuneOptimizer(adamw, enable_fusion=True, capture_graph=False)
        return params, opt, opt._subsystem("graphs")
    opt = mod.KitsuneOptimizer(adamw, enable_fusion=True)
    graphs = opt._subsystem("graphs")
    graphs.backend = StandInGraphs()
    opt._replan()
    if not graphs.active:
        raise SystemExit(f"{mod.__name__}: the graph subsystem is inactive: {graphs.reason}")
    return params, opt, graphs


def stub_launches(mod: ModuleType) -> None:
    """The fused executor's device half does nothing (the eager path's launches would run in the interpreter)."""
    executor = importlib.import_module(f"{mod.__name__}.fusion.executor")
    executor.FusionSubsystem.launch = lambda self, s, units: None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", type=Path, help="another commit's kitsune package folder, timed beside this one")
    parser.add_argument("--other-first", action="store_true", help="build the other commit's optimizer first")
    parser.add_argument("--sets", default="gpt2,many", help="comma-separated kitsune bench sets")
    parser.add_argument("--scale", type=float, default=1e-3, help="elements per tensor, as kitsune bench --scale")
    parser.add_argument("--grads", default="kept,fresh", help="comma-separated: kept, fresh, sched")
    parser.add_argument(
        "--path", choices=["steady", "eager"], default="steady",
        help="steady: the one line's steady replay; eager: capture_graph=False, every step the full path",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=50, help="steps a round")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    import kitsune
    from kitsune.bench.params import fresh_grads

    sides = {"this": kitsune}
    if args.other is not None:
        other = load_other(args.other)
        sides = {"other": other, "this": kitsune} if args.other_first else {"this": kitsune, "other": other}
    for name, mod in sides.items():
        native = getattr(mod, "_native", None)
        ready = native is not None and native.wait(timeout=600) is not None
        print(f"{name}: native address check {'ready' if ready else 'not ready: the Python check runs'}")
        if args.path == "eager":
            stub_launches(mod)
    modes = args.grads.split(",")
    results: dict[str, Any] = {}
    for set_name in args.sets.split(","):
        built = {name: build(mod, set_name, args.scale, args.path) for name, mod in sides.items()}
        gen = torch.Generator().manual_seed(1)
        scheds = {}
        for name, (params, opt, _) in built.items():  # warm-up (3 steps), capture, then the steady replay
            if "sched" in modes:
                scheds[name] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)
            for _ in range(8):
                fresh_grads(params, gen)
                opt.step()
        times: dict[str, dict[str, list[float]]] = {name: {mode: [] for mode in modes} for name in sides}
        steady = {name: graphs.steady_replays for name, (_, _, graphs) in built.items()}
        names = list(sides)
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                params, opt, _ = built[name]
                for mode in modes:
                    host = []
                    for _ in range(args.steps):
                        if mode == "fresh":
                            fresh_grads(params, gen)
                        elif mode == "sched":
                            scheds[name].step()
                        t0 = time.perf_counter_ns()
                        opt.step()
                        host.append((time.perf_counter_ns() - t0) / 1e3)
                    times[name][mode].append(statistics.median(host))
        total = args.rounds * args.steps * len(modes)
        row = {}
        for name, (params, _, graphs) in built.items():
            row[name] = {mode: statistics.median(v) for mode, v in times[name].items()}
            row[name]["steady_share"] = (graphs.steady_replays - steady[name]) / total
            line = ", ".join(f"{mode} {row[name][mode]:.1f} us" for mode in modes)
            print(f"{set_name} ({len(params)} tensors) {name}: {line}; steady replays {row[name]['steady_share']:.0%}")
        results[set_name] = row
    if args.json is not None:
        env = {"torch": torch.__version__, "kitsune": kitsune.__version__, "cpu": os.cpu_count()}
        config = {**vars(args), "other": str(args.other), "json": str(args.json)}
        args.json.write_text(json.dumps({"environment": env, "config": config, **results}, indent=1))


if __name__ == "__main__":
    main()
