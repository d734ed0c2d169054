"""Two kitsune commits side by side in one process, in alternating rounds: is the step as fast as before?

Host times move by up to 2x between processes on the same machine, so a regression check compares the commits in
one process. The other commit's package is loaded under another name (``kitsune_other``, its imports rewritten), and
each case builds one optimizer per commit over the same seeded params, warms both up, then times rounds of steps,
alternating which commit goes first: ms per step back to back (CUDA events) and host ms of ``step()`` (the GPU
synchronised before each step), medians over the rounds. Run it twice with ``--other-first`` and without: the
optimizer built first can be the slower one on the ``many`` set, whichever commit it is.

    git archive 9668348 kitsune | tar -x -C /tmp/other        # the commit to compare against
    python3 benchmarks/ab.py --other /tmp/other/kitsune --json ab.json
    python3 benchmarks/ab.py --other /tmp/other/kitsune --other-first --json ab-other-first.json
    python3 benchmarks/ab.py --other /tmp/other/kitsune --sets gpt2 --cases default,sched   # some cases only

GPU only. Cases: AdamW on gpt2, many and llama1b (``KitsuneOptimizer(..., enable_fusion=True)``), gpt2 and many with
``GraphConfig(static_addresses=True)``, with ``capture_graph=False`` (``eager``: every step the full path) and with
grads that move every step (``moving``: `kitsune.bench.params.fresh_grads` before each step, as a training loop's
``zero_grad()`` and backward leave them; in the back-to-back time, the same for both commits, and outside the host
time), with an LR scheduler stepped before every step (``sched``: `LambdaLR`, outside the host time; each step
uploads the new hyperparameters), and gpt2's float16 AMP + clip 1.0 + zero-in-step phase with fresh grads.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

CASES = [("gpt2", "default"), ("gpt2", "static"), ("gpt2", "eager"), ("gpt2", "moving"),
         ("many", "default"), ("many", "static"), ("many", "eager"), ("many", "moving"),
         ("gpt2", "sched"), ("many", "sched"), ("gpt2", "phase"), ("llama1b", "default")]  # fmt: skip


def load_other(path: Path) -> ModuleType:
    """The kitsune package at ``path`` (another commit's), imported as ``kitsune_other``."""
    root = Path(tempfile.mkdtemp())
    shutil.copytree(path, root / "kitsune_other")
    for f in (root / "kitsune_other").rglob("*.py"):
        text = re.sub(r"\b(from|import) kitsune\b", r"\1 kitsune_other", f.read_text())
        f.write_text(re.sub(r'"kitsune\.(fusion|clip)"', r'"kitsune_other.\1"', text))  # logger names
    sys.path.append(str(root))
    return importlib.import_module("kitsune_other")


def make(mod: ModuleType, params: list[torch.nn.Parameter], variant: str) -> Any:
    adamw = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    if variant == "static":
        graphs = mod.GraphConfig(static_addresses=True)
        return mod.KitsuneOptimizer(adamw, config=mod.KitsuneConfig(fusion=mod.FusionConfig(), graphs=graphs))
    if variant == "eager":  # every step the full path
        return mod.KitsuneOptimizer(adamw, enable_fusion=True, capture_graph=False)
    if variant == "phase":
        amp, grads = mod.AMPConfig(dtype=torch.float16), mod.GradConfig(max_norm=1.0, zero_in_step=True)
        return mod.KitsuneOptimizer(adamw, enable_fusion=True, enable_amp=True, amp_config=amp, grad_config=grads)
    return mod.KitsuneOptimizer(adamw, enable_fusion=True)


def case(sides: dict[str, ModuleType], set_name: str, variant: str, rounds: int, steps: int) -> dict[str, Any]:
    from kitsune.bench.params import fresh_grads, get_param_set, make_params

    device = torch.device("cuda")
    pset = get_param_set(set_name)
    step_of, prep_of = {}, {}
    for name, mod in sides.items():
        params = make_params(pset, device, 0)
        opt = make(mod, params, variant)
        sched = None
        if variant == "sched":
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.999**s)
            opt.step()  # a step before the scheduler's first, as a training loop's order has it
        one = torch.ones((), device=device)
        gen = torch.Generator(device=device).manual_seed(1)

        def step(opt: Any = opt, params: list = params, one: torch.Tensor = one, gen: Any = gen) -> None:
            if variant == "phase":  # fresh grads, and the scaled loss optimizer.backward would have made
                for p in params:
                    p.grad.normal_(generator=gen)
                opt.scale_loss(one)
            opt.step()
            if variant == "phase":
                opt.zero_grad(set_to_none=False)

        def prep(params: list = params, gen: Any = gen, sched: Any = sched) -> None:
            if variant == "moving":
                fresh_grads(params, gen)
            elif sched is not None:  # a new lr before every step, as a scheduler stepped each iteration gives
                sched.step()

        for _ in range(12):  # warm-up, capture, then the steady replay
            prep()
            step()
        step_of[name], prep_of[name] = step, prep
    times: dict[str, dict[str, list[float]]] = {name: {"ms": [], "host_ms": []} for name in sides}
    names = list(sides)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            step, prep = step_of[name], prep_of[name]
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(steps):
                prep()
                step()
            end.record()
            torch.cuda.synchronize()
            times[name]["ms"].append(start.elapsed_time(end) / steps)
            host = []
            for _ in range(steps):
                prep()
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                host.append((time.perf_counter() - t0) * 1e3)
            times[name]["host_ms"].append(statistics.median(host))
    out = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    del step_of, prep_of
    torch.cuda.empty_cache()
    return out


def _try_import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _variants() -> list[str]:
    return list(dict.fromkeys(variant for _, variant in CASES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--other", type=Path, required=True, help="the other commit's kitsune package folder")
    parser.add_argument("--other-first", action="store_true", help="build the other commit's optimizer first")
    parser.add_argument("--sets", default="gpt2,many,llama1b", help="comma-separated: gpt2,many,llama1b")
    parser.add_argument(
        "--cases", default=None, help="comma-separated cases to run (default: all): " + ",".join(_variants())
    )
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=20, help="steps a round")
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args()
    cases = None if args.cases is None else args.cases.split(",")
    if cases is not None and set(cases) - set(_variants()):
        parser.error(f"unknown case(s) {', '.join(sorted(set(cases) - set(_variants())))}: {', '.join(_variants())}")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA GPU")
    import kitsune

    other = load_other(args.other)
    sides = {"other": other, "this": kitsune} if args.other_first else {"this": kitsune, "other": other}
    for name, mod in sides.items():  # a commit with the native address check: time it built, as users run it
        native = _try_import(f"{mod.__name__}._native")
        if native is not None:
            t0 = time.perf_counter()
            ready = native.wait(timeout=600) is not None
            print(f"{name}: native address check {'ready' if ready else native.reason()} after "
                  f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    results = {}
    for set_name, variant in CASES:
        if set_name not in args.sets.split(",") or (cases is not None and variant not in cases):
            continue
        r = results[f"{set_name}/{variant}"] = case(sides, set_name, variant, args.rounds, args.steps)
        this, them = r["this"], r["other"]
        print(
            f"{set_name:8s} {variant:8s} other {them['ms']:.3f} ms (host {them['host_ms']:.3f})  this {this['ms']:.3f}"
            f" ms (host {this['host_ms']:.3f})  this/other {this['ms'] / them['ms']:.3f}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
