"""How far kitsune's losses are from torch's, next to how far two identical torch runs are from each other.

python scripts/e2e-loss-spread.py                        # on a GPU: the e2e GPT-2 124M, bf16 autocast, 200 steps
python scripts/e2e-loss-spread.py --device cpu --steps 5 # a dry run on the tiny model

bf16 backward on a GPU is not bitwise deterministic (atomics in some kernels), so two runs of the same torch loop
from the same weights on the same batches part after a while. This trains, one after another, the sides named in
``--sides`` (``kitsune.bench.e2e.SIDES``; a name given twice trains twice) and prints, per window of steps, the
largest loss difference of each side from the first one. kitsune's distance from torch means something only next
to torch's own distance from itself.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from kitsune.bench.e2e import build_side, e2e_inputs, train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--sides", default="torch,torch,kitsune,kitsune,torch_noclip,torch_noclip,kitsune_noclip")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg, data, init = e2e_inputs(device)
    losses: list[tuple[str, list[float]]] = []
    for name in args.sides.split(","):
        side = build_side(name, cfg, init, device)
        run = [train_step(side, data[i % len(data)]).detach() for i in range(args.steps)]
        losses.append((name, [float(x) for x in run]))
        del side
        if device.type == "cuda":
            torch.cuda.empty_cache()
    windows = [(a, min(a + args.window, args.steps)) for a in range(0, args.steps, args.window)]
    out: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__}
    out["windows"] = windows
    # each side against the first earlier side of its kind (clipped against clipped, unclipped against unclipped)
    print(f"== {out['device']}, torch {torch.__version__}: largest |loss difference| per window of steps")
    print("   " + " ".join(f"{a:>4}-{b - 1:<4}" for a, b in windows))
    for k, (name, run) in enumerate(losses):
        clipped = "noclip" not in name
        ref = next((j for j in range(k) if ("noclip" not in losses[j][0]) == clipped), None)
        if ref is None:
            continue
        diffs = [max(abs(x - y) for x, y in zip(run[a:b], losses[ref][1][a:b], strict=True)) for a, b in windows]
        label = f"{name} (#{k}) vs {losses[ref][0]} (#{ref})"
        out[label] = diffs
        print(f"  {label}: " + " ".join(f"{d:9.5f}" for d in diffs))
    out["losses"] = {f"{name} (#{k})": run for k, (name, run) in enumerate(losses)}
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
