"""A/B of the fused Muon step on a GPU: the captured step with each large same-shape batch cut in two halves on two
streams, against the same step with whole batches, and torch.optim.Muon, timed in turns (rounds of back-to-back
steps, each optimizer in every round and in every place of a round's order, after steps of its own) so that a drift
of the machine falls on all of them alike.

python scripts/muon-step-ab.py --json $OUT/muon-ab.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from kitsune import KitsuneOptimizer
from kitsune.bench.muon import MUON_KWARGS, STEP_SHAPES
from kitsune.bench.timing import time_steps
from kitsune.fusion import muon_unit


def _make(kind: str, shapes: list[tuple[int, int]], gen: torch.Generator) -> tuple[torch.optim.Optimizer, list]:
    params = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=gen)) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device="cuda", generator=gen)
    base = torch.optim.Muon(params, **MUON_KWARGS)
    if kind == "torch":
        return base, params
    keep = muon_unit.CUT_MIN_TILES
    muon_unit.CUT_MIN_TILES = keep if kind == "cut" else 2**62  # read when the units are built
    try:
        opt = KitsuneOptimizer(base, enable_fusion=True)
        for _ in range(6):  # warm-up steps, then the capture
            opt.step()
    finally:
        muon_unit.CUT_MIN_TILES = keep
    return opt, params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="x".join(map(str, STEP_SHAPES[0])) + f"*{len(STEP_SHAPES)}",
                        help="ROWSxCOLS*COUNT[,...], default the bench's Muon step")  # fmt: skip
    parser.add_argument("--rounds", type=int, default=15, help="a multiple of 3: each optimizer in each place")
    parser.add_argument("--steps", type=int, default=10, help="steps per round and optimizer")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    shapes: list[tuple[int, int]] = []
    for spec in args.shapes.split(","):
        dims, _, count = spec.partition("*")
        rows, cols = (int(v) for v in dims.split("x"))
        shapes += [(rows, cols)] * int(count or 1)
    gen = torch.Generator("cuda").manual_seed(0)
    kinds = ["torch", "whole", "cut"]
    opts = {k: _make(k, shapes, gen) for k in kinds}
    for k in kinds[1:]:
        graphs = opts[k][0]._subsystem("graphs")  # type: ignore[union-attr]
        print(f"{k}: graph captures {graphs.captures}, replays {graphs.replays}", flush=True)
    medians: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(args.rounds):
        # each optimizer in each place of the order equally often, and timed only after steps of its own: the GPU's
        # clocks follow the power drawn just before (after torch.optim.Muon's host-bound steps a step ran ~10% faster)
        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]
        for k in order:
            opt = opts[k][0]
            for _ in range(args.steps):
                opt.step()
            medians[k].append(statistics.median(time_steps(opt.step, args.steps, torch.device("cuda")).device_ms))
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": args.shapes}
    for k in kinds:
        result[f"{k}_ms"] = statistics.median(medians[k])
    for k in kinds[1:]:
        result[f"speedup_{k}"] = statistics.median(t / o for t, o in zip(medians["torch"], medians[k], strict=True))
    result["cut_over_whole"] = statistics.median(w / c for w, c in zip(medians["whole"], medians["cut"], strict=True))
    result["rounds"] = medians
    for key, value in result.items():
        if key != "rounds":
            print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
