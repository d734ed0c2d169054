"""Where re-allocated grads land, and what the one-line step costs with them: kept grads against grads freed and
re-allocated before every step (``zero_grad()`` then ``backward()``'s pattern), in one process.

python benchmarks/fresh-grads.py --json fresh-grads.json     # on a GPU: the many set, full size
python benchmarks/fresh-grads.py --device cpu                # a dry run at tiny scale (no graph replays on a CPU)

It builds ``KitsuneOptimizer(torch.optim.AdamW(params), enable_fusion=True)`` over the set's params and runs it in
alternating blocks of ``--steps`` steps, each block with the grads kept (the same tensors, new values written in
place) or fresh (`kitsune.bench.params.fresh_grads`: every grad set to None and a new one allocated while the last
ones still hold their blocks, so the grads move every step, as a training loop's do), ``--rounds`` blocks of each.
Per block: how many steps met grads at other addresses than the step before, how many steps took the graph's steady
replay (the step's short path: every param where the last step found it, every grad there too or moved as the
kernels take it) and how many another replay or no replay, and the host time of ``step()`` (started with the GPU
idle, as `kitsune bench`'s host column): median over the block's steps. A third mode, ``python``, is ``fresh`` with
the native read of the grads declined (the native module's ``follow`` answering "cannot", as where a grad is not
as the kernels take it), so the step takes the full path and reads the grads' addresses in Python, as before
`e559b94` and `07f8a25`: that path's cost, beside the steady replay's, in one process. A fourth, ``settled``, is
``fresh`` with one 64 KiB host allocation made and freed after the grads' making, outside the timer. Freeing the
last grads leaves thousands of small blocks (their TensorImpls and storages) in glibc's fast bins, and the first
allocation of a kilobyte or more after that sorts them all, on cold memory, whoever makes it: in ``fresh`` that is
the step (the page-locked tensor its native read writes the new addresses into), in a training loop whichever
allocation comes first after ``zero_grad()`` or backward's frees. ``settled`` times the step with that work done
before it. It prints, per mode, the medians over the blocks.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from kitsune import KitsuneOptimizer, __version__, _native
from kitsune.bench.cli import add_device_args, device_and_defaults, write_script_json
from kitsune.bench.params import fresh_grads, get_param_set, make_params, refill_grads
from kitsune.bench.timing import native_check_ready, percentile, synchronize


class _DeclinedRead:
    """The native module with its read of the grads declined: ``follow`` answers "cannot" (as where a grad is not as
    the kernels take it), so every step takes the full path and reads the grads in Python; the module's other calls
    (the params' check) are its own."""

    def __init__(self, module: Any) -> None:
        self.module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    @staticmethod
    def follow(*args: Any) -> int:
        return _native.OTHER


MODES = ("kept", "fresh", "python", "settled")
SETTLE = 1 << 16
"""``settled``'s allocation: well above the size (1 KiB) from which glibc sorts its fast bins first."""


def block(
    opt: KitsuneOptimizer,
    params: list[torch.nn.Parameter],
    mode: str,
    steps: int,
    gen: torch.Generator,
    device: torch.device,
) -> dict[str, float]:
    graphs = opt._subsystem("graphs")
    replays, steady = graphs.replays, graphs.steady_replays
    before = [p.grad.data_ptr() for p in params]
    moved, host = 0, []
    checks = _native.CHECKS
    declined = mode == "python" and checks is not None
    if declined:
        _native.CHECKS = _DeclinedRead(checks)
    try:
        for _ in range(steps):
            (refill_grads if mode == "kept" else fresh_grads)(params, gen)
            if mode == "settled":
                bytearray(SETTLE)  # made and freed at once: the allocator's sorting of the freed grads happens here
            synchronize(device)
            t0 = time.perf_counter_ns()
            opt.step()
            host.append((time.perf_counter_ns() - t0) / 1e3)
            now = [p.grad.data_ptr() for p in params]  # after the step: reading them before would warm its caches
            moved += now != before
            before = now
        synchronize(device)
    finally:
        if declined:  # a module the build finished meanwhile stays
            _native.CHECKS = checks
    return {
        "moved": moved,
        "steady": graphs.steady_replays - steady,
        "other_replays": graphs.replays - replays - (graphs.steady_replays - steady),
        "host_us": percentile(host, 50),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_args(parser)
    parser.add_argument("--set", default="many", help="a parameter set of kitsune bench")
    parser.add_argument("--rounds", type=int, default=None, help="blocks of each mode (default 20; 2 on a CPU)")
    parser.add_argument("--steps", type=int, default=20, help="steps a block")
    parser.add_argument("--warmup", type=int, default=20, help="steps before timing, grads fresh")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = device_and_defaults(parser, args, rounds=(2, 20))
    scale, rounds = args.scale, args.rounds
    print(f"torch {torch.__version__}, kitsune {__version__}, {args.set} x {scale:g}; {rounds} blocks of each mode")
    print(native_check_ready(device))
    params = make_params(get_param_set(args.set, scale), device, seed=0)
    opt = KitsuneOptimizer(torch.optim.AdamW(params), enable_fusion=True)
    gen = torch.Generator(device=device).manual_seed(1)
    for _ in range(args.warmup):
        fresh_grads(params, gen)
        opt.step()
    blocks: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for r in range(rounds):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            blocks[mode].append(block(opt, params, mode, args.steps, gen, device))
    out: dict[str, Any] = {"config": {"set": args.set, "scale": scale, "rounds": rounds, "steps": args.steps}}
    for mode, rows in blocks.items():
        summary = {key: percentile([b[key] for b in rows], 50) for key in rows[0]}
        out[mode] = {"median": summary, "blocks": rows}
        print(
            f"  {mode:7s}: steps whose grads moved {summary['moved']:.0f} of {args.steps}, steady replays "
            f"{summary['steady']:.0f}, other replays {summary['other_replays']:.0f}, host {summary['host_us']:.1f} us "
            "a step (medians over the blocks)"
        )
    if args.json is not None:
        write_script_json(args.json, device, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
