"""What ``profile=True`` costs a training step: the one-line AdamW with the profiler off and on, in one process.

python benchmarks/profiler-cost.py --json profiler-cost.json     # on a GPU: the gpt2 and many sets, full size
python benchmarks/profiler-cost.py --device cpu                  # a dry run at tiny scale (fusion inactive there)

For each parameter set of ``kitsune bench`` (``--sets``) it builds six optimizers over copies of the same seeded
params, ``KitsuneOptimizer(torch.optim.AdamW(params), enable_fusion=True)`` with the profiler off, on (its defaults:
the NVML sampler, the probe after ``sample_after`` steps) and on without the probe (``probe_steps=0``, as `kitsune
bench`'s ``profiled`` variant), two of each, in a palindrome build order (off, on, noprobe, noprobe, on, off), the
rounds split between three such orders (`ORDERS`) so that each side is built in every pair of places: on an H200 the
place alone moved a side's figure by up to 15% (``--order``, repeated, picks others). Each is warmed up past the
profiler's sampled windows, so the timed steps are the steady ones. Each order's optimizers are built, warmed up and
timed, and freed before the next order's. ``--blocks`` rounds in all; in each, every optimizer runs ``--steps``
steps back to back after ``gc.collect()``, in an order that rotates from round to round: ms per step between two
CUDA events around the block (host time included: a host-bound step keeps the GPU waiting), host ms per step, and
the host ms of the block's first step (cold: ``gc.collect()`` walks every object, as a forward and backward pass
leave the CPU's caches) and the median of the others (warm); a round's figure for a side is the mean of its two
optimizers. It prints, per side, the medians and the 10th-90th percentiles over the rounds, each profiled side's
overhead over off in % (the median of the rounds' ratios, and their spread) and in host ms (all steps, the first,
the later ones), and the graphs' steady replays of each side (every side should take it). Last, the profiler alone:
one more profiler over the same params times ``--blocks`` x 10 x ``--steps`` empty steps (what a steady step adds to
the host: ``wants_baseline``, ``start``, ``stop`` and the batched reads of its events), the median over the blocks
in microseconds a step, less the loop around it; then the same with every step timed on the device and with one in
8 (the default times one in ``ProfilerConfig.device_time_every``, 32). And the profiler toggled: one more
optimizer with the profiler on (its defaults), warmed up past its windows, then ``--toggles`` rounds in which its
steps run ``--steps`` at a time with the profiler on and paused (`Subsystem.deactivate`, then `activate`), in
alternating order: the same objects on both sides, so where an optimizer was built cannot move the difference (the
NVML sampler's thread runs through both, so its share is left out); each round's device % and host us, on over
paused.

``--json PATH`` writes the numbers, the environment and the profiled side's sampled-window shares.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from kitsune import KitsuneOptimizer, __version__
from kitsune.bench.cli import add_device_args, device_and_defaults
from kitsune.bench.params import get_param_set, make_params
from kitsune.bench.timing import native_check_ready, percentile, time_block, time_steps


def spread(values: list[float]) -> dict[str, float]:
    return {"p50": percentile(values, 50), "p10": percentile(values, 10), "p90": percentile(values, 90)}


SIDES = {"off": None, "on": {}, "noprobe": {"probe_steps": 0}}
"""Each side's profiler settings: off; on with its defaults (the probe inside the warm-up, the NVML sampler); on
without the probe (what `kitsune bench`'s `profiled` variant ran in the runs recorded on 2026-12-04)."""
ORDERS = (
    ("off", "on", "noprobe", "noprobe", "on", "off"),
    ("on", "noprobe", "off", "off", "noprobe", "on"),
    ("noprobe", "off", "on", "on", "off", "noprobe"),
)
"""The build orders, each a palindrome, the rounds split between them: across the three each side is built in
every pair of places (first and last, second and fifth, third and fourth). On an H200 the place alone moved a side's
figure by up to 15% on the ``many`` set (the optimizers built second and fifth ran slower, whichever side they
were), more than the profiler's own cost."""
KEYS = ("ms", "host_ms", "first_ms", "later_ms")


def build(set_name: str, scale: float, device: torch.device, side: str) -> KitsuneOptimizer:
    from kitsune.config import FusionConfig, KitsuneConfig, ProfilerConfig

    params = make_params(get_param_set(set_name, scale), device, seed=0)
    settings = SIDES[side]
    profiler = {} if settings is None else {"profiler": ProfilerConfig(**settings)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # on a CPU: "fusion was asked for but is inactive" (printed below)
        return KitsuneOptimizer(torch.optim.AdamW(params), config=KitsuneConfig(fusion=FusionConfig(), **profiler))


def profiler_alone_us(params: list[torch.Tensor], args: argparse.Namespace, every: int | None = None) -> dict[str, Any]:
    """Host microseconds a step of a profiler over ``params`` costs, with nothing inside the step, timing one step in
    ``every`` on the device (``ProfilerConfig.device_time_every``; None: its default); ``loop_us`` is the same loop
    without the profiler's calls (the step counter and `StepState`), already subtracted from ``p50`` etc."""
    from kitsune.config import ProfilerConfig
    from kitsune.profiler import Profiler
    from kitsune.subsystem import StepState

    extra = {} if every is None else {"device_time_every": every}
    prof = Profiler(ProfilerConfig(enabled=True, nvml_interval_s=0, sample_after=0, probe_steps=0, **extra))
    prof.plan(params, "none", None)
    per_block, loops, step, n = [], [], 0, args.steps * 10
    for _ in range(args.blocks):
        gc.collect()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            step += 1
            s = StepState(step, prof.wants_baseline(True))
            prof.start(s)
            prof.stop(s)
        t1 = time.perf_counter_ns()
        for _ in range(n):
            s = StepState(step, False)
        loops.append((time.perf_counter_ns() - t1) / 1e3 / n)
        per_block.append((t1 - t0) / 1e3 / n - loops[-1])
    assert len(prof.records) == step  # every step was recorded
    return {**spread(per_block), "loop_us": percentile(loops, 50), "device_time_every": prof.config.device_time_every}


def run_order(
    set_name: str, order: tuple[str, ...], rounds: int, args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, dict[str, list[float]]], dict[str, Any]]:
    """``rounds`` rounds over six optimizers built in ``order``: per side, each round's figures (the mean of the
    side's optimizers); the graphs' steady replays, the fusion route and the sampled windows. The optimizers and
    their params are gone when it returns."""
    opts = [build(set_name, args.scale, device, side) for side in order]
    for opt in opts:
        for _ in range(args.warmup):
            opt.step()
    times: dict[str, dict[str, list[float]]] = {side: {k: [] for k in KEYS} for side in SIDES}
    for block in range(rounds):
        round_: dict[str, dict[str, list[float]]] = {side: {k: [] for k in KEYS} for side in SIDES}
        for i in range(len(opts)):
            k = (i + block) % len(opts)  # the order rotates from round to round
            for key, value in time_block(opts[k].step, args.steps, device).items():
                round_[order[k]][key].append(value)
        for side, r in round_.items():
            for key, values in r.items():
                times[side][key].append(sum(values) / len(values))
    graphs = [opt._subsystem("graphs").report()["steady_replays"] for opt in opts]
    fusion = opts[0]._subsystem("fusion")
    for opt, side in zip(opts, order, strict=True):
        if side != "off":
            assert opt.profiler is not None
            opt.profiler.close()  # the NVML sampler's thread
    on = opts[order.index("on")].profiler
    assert on is not None
    info = {
        "steady_replays": {side: [n for n, s in zip(graphs, order, strict=True) if s == side] for side in SIDES},
        "fusion": "active" if fusion.active else f"inactive: {fusion.reason}",
        "windows": [w.model_dump() for w in on.get_metrics().windows or []],
    }
    del opts, opt, fusion, on  # nothing of this order's optimizers outlives it
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return times, info


def order_ratios(raw: dict[str, dict[str, list[float]]], side: str) -> list[float]:
    return [a / b for a, b in zip(raw[side]["ms"], raw["off"]["ms"], strict=True)]


def toggled(set_name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One profiled optimizer, its profiler on and paused in alternating rounds: each round's device % (median ms
    a step back to back, on over paused) and host us a step (median, on minus paused)."""
    opt = build(set_name, args.scale, device, "on")
    try:
        for _ in range(args.warmup):
            opt.step()
        profiler = opt._subsystem("profiler")
        pct, host_us = [], []
        for r in range(args.toggles):
            timed = {}
            for side in ("on", "paused") if r % 2 == 0 else ("paused", "on"):
                if side == "paused":
                    profiler.deactivate("paused by profiler-cost.py")
                try:
                    t = time_steps(opt.step, args.steps, device)
                finally:
                    profiler.activate()
                timed[side] = (percentile(t.device_ms, 50), percentile(t.host_ms, 50))
            pct.append(100 * (timed["on"][0] / timed["paused"][0] - 1))
            host_us.append(1e3 * (timed["on"][1] - timed["paused"][1]))
        steps_timed = profiler.report()["steps_timed"]
    finally:
        opt._subsystem("profiler").close()  # the NVML sampler's thread
    return {"rounds": args.toggles, "device_pct": spread(pct), "host_us": spread(host_us), "steps_timed": steps_timed}


def measure(set_name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """The rounds split between the build orders (``args.orders``), each order's optimizers built, warmed up, timed
    and freed before the next order's are built."""
    times: dict[str, dict[str, list[float]]] = {side: {k: [] for k in KEYS} for side in SIDES}
    by_order = []
    orders = args.orders
    for j, order in enumerate(orders):
        rounds = len(range(j, args.blocks, len(orders)))
        order_times, info = run_order(set_name, order, rounds, args, device)
        for side, t in order_times.items():
            for key, values in t.items():
                times[side][key].extend(values)
        by_order.append({"order": list(order), "rounds": rounds, **info, "raw": order_times})
    out: dict[str, Any] = {side: {k: spread(v) for k, v in t.items()} for side, t in times.items()}
    off = times["off"]
    for side in ("on", "noprobe"):
        t = times[side]
        ratios = [a / b for a, b in zip(t["ms"], off["ms"], strict=True)]
        out[f"{side}_overhead_pct"] = {k: 100 * (v - 1) for k, v in spread(ratios).items()}
        for key in ("host_ms", "first_ms", "later_ms"):
            out[f"{side}_{key}_delta"] = spread([a - b for a, b in zip(t[key], off[key], strict=True)])
        # each order's median ratio: a side whose figure moves with the build order measures its place, not itself
        out[f"{side}_overhead_pct_by_order"] = [
            100 * (percentile(order_ratios(o["raw"], side), 50) - 1) for o in by_order
        ]
    out["steady_replays"] = {side: sum((o["steady_replays"][side] for o in by_order), []) for side in SIDES}
    out["fusion"], out["windows"] = by_order[0]["fusion"], by_order[0]["windows"]
    out["orders"] = [{k: v for k, v in o.items() if k != "raw"} for o in by_order]
    params = make_params(get_param_set(set_name, args.scale), device, seed=0)
    out["profiler_alone_us"] = profiler_alone_us(params, args)
    # how much of it is the device timing: every step timed, and one in 8 (the default before one in 32)
    out["profiler_alone_us_by_every"] = [profiler_alone_us(params, args, every) for every in (1, 8)]
    out["toggled"] = toggled(set_name, args, device)
    out["raw"] = times
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--sets", default="gpt2,many", help="parameter sets of kitsune bench, comma-separated")
    parser.add_argument(
        "--blocks", type=int, default=None, help="timed rounds, split between the build orders (default 30; 3 on a CPU)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per optimizer a round (default 20; 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=30, help="steps before timing (past the sampled windows)")
    parser.add_argument(
        "--toggles", type=int, default=None, help="rounds of the profiler toggled (default 60; 2 on a CPU)"
    )
    parser.add_argument(
        "--order",
        action="append",
        default=None,
        help="a build order, comma-separated sides (off, on, noprobe), each at least once; repeat the option for "
        "several (default: the three of ORDERS)",
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    args.orders = [tuple(o.split(",")) for o in args.order] if args.order else list(ORDERS)
    for order in args.orders:
        if set(order) != set(SIDES):
            parser.error(f"--order {','.join(order)}: name each of {', '.join(SIDES)} at least once, nothing else")
    device = device_and_defaults(parser, args, blocks=(3, 30), steps=(3, 20), toggles=(2, 60))
    if args.blocks < len(args.orders):
        parser.error(f"--blocks {args.blocks}: at least one round for each of the {len(args.orders)} build orders")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(f"{name}, torch {torch.__version__}, kitsune {__version__}; {args.blocks} rounds of {args.steps} steps")
    print(native_check_ready(device))  # the steps as a run past its first minute takes them
    results: dict[str, Any] = {}
    for set_name in args.sets.split(","):
        r = results[set_name] = measure(set_name, args, device)
        print(f"{set_name} (scale {args.scale:g}, fusion {r['fusion']}):")
        for side in SIDES:
            ms, host, first, later = (r[side][k] for k in ("ms", "host_ms", "first_ms", "later_ms"))
            print(
                f"  {side:8s} {ms['p50']:.4f} ms/step (p10-p90 {ms['p10']:.4f}-{ms['p90']:.4f}), "
                f"host {host['p50']:.4f} ms (p10-p90 {host['p10']:.4f}-{host['p90']:.4f}): the first step after "
                f"gc.collect() {first['p50']:.4f}, the later ones {later['p50']:.4f}; "
                f"steady replays {r['steady_replays'][side]}"
            )
        for side in ("on", "noprobe"):
            pct, host = r[f"{side}_overhead_pct"], r[f"{side}_host_ms_delta"]
            first, later = r[f"{side}_first_ms_delta"], r[f"{side}_later_ms_delta"]
            print(
                f"  {side} over off: {pct['p50']:+.2f}% of the step (p10 {pct['p10']:+.2f}%, p90 {pct['p90']:+.2f}%), "
                f"host {host['p50']:+.4f} ms/step (p10 {host['p10']:+.4f}, p90 {host['p90']:+.4f}); "
                f"the first step {first['p50']:+.4f} ms, the later ones {later['p50']:+.4f} ms; by build order "
                + ", ".join(f"{v:+.2f}%" for v in r[f"{side}_overhead_pct_by_order"])
            )
        for alone in (r["profiler_alone_us"], *r["profiler_alone_us_by_every"]):
            every, loop = alone["device_time_every"], alone["loop_us"]
            print(
                f"  profiler alone {alone['p50']:.2f} us/step (p10-p90 {alone['p10']:.2f}-{alone['p90']:.2f}), "
                f"one step in {every} timed on the device; the loop around it {loop:.2f} us"
            )
        tog = r["toggled"]
        pct, host = tog["device_pct"], tog["host_us"]
        print(
            f"  toggled on one optimizer ({tog['rounds']} rounds): on over paused {pct['p50']:+.2f}% of the step "
            f"(p10 {pct['p10']:+.2f}%, p90 {pct['p90']:+.2f}%), host {host['p50']:+.2f} us/step (p10 "
            f"{host['p10']:+.2f}, p90 {host['p90']:+.2f})"
        )
        for w in r["windows"]:
            print(f"  window {w['window']}: {w['steps']} steps, {w['ms']:.1f} ms (in the warm-up, not timed)")
    if args.json is not None:
        env = {"device": name, "torch": torch.__version__, "kitsune": __version__, "cuda": torch.version.cuda}
        config = {k: getattr(args, k) for k in ("scale", "blocks", "steps", "warmup", "toggles")}
        args.json.write_text(json.dumps({"environment": env, "config": config, "sets": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
